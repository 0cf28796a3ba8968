"""Model definitions: ModelConfig resolution, the model families, and the architecture registry."""

from tokenos.models.build import build_model
from tokenos.models.config import ModelConfig, default_model_path, load_model_config
from tokenos.models.registry import ARCHITECTURES

__all__ = ["ARCHITECTURES", "ModelConfig", "build_model", "default_model_path", "load_model_config"]
