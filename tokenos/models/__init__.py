"""Model definitions: ModelConfig resolution, the Llama family, and the architecture registry."""

from tokenos.models.config import ModelConfig, default_model_path, load_model_config
from tokenos.models.registry import MODEL_REGISTRY, build_model

__all__ = ["MODEL_REGISTRY", "ModelConfig", "build_model", "default_model_path", "load_model_config"]
