"""HF architecture name -> model class, and ``build_model``: config in, loaded model out."""

from __future__ import annotations

import torch
from torch import nn

from tokenos.models.bamba import BambaForCausalLM
from tokenos.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenos.models.falcon_h1 import FalconH1ForCausalLM
from tokenos.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from tokenos.models.llama import LlamaForCausalLM
from tokenos.models.mamba2 import Mamba2ForCausalLM
from tokenos.models.nemotron_h import NemotronHForCausalLM
from tokenos.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Hybrids (class attribute is_hybrid = True): forward takes a HybridMetadata, see models/hybrid.py.
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"Unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


def build_model(model_config: ModelConfig, load: bool = True) -> nn.Module:
    """Instantiate the model in ``model_config.dtype`` and (by default) load its checkpoint."""
    from tokenos.model_loader import load_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        model = model_class(model_config.architecture)(model_config)
    finally:
        torch.set_default_dtype(previous)
    if load:
        load_weights(model, model_config)
    return model.eval()
