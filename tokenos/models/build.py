"""`build_model`: a resolved `ModelConfig` in, the model with its checkpoint loaded out."""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from tokenos.model_loader import load_weights
from tokenos.models.config import ModelConfig
from tokenos.models.registry import model_class

logger = logging.getLogger("tokenos.models")


def build_model(model_config: ModelConfig, load: bool = True) -> nn.Module:
    """Instantiate the model in ``model_config.dtype`` and (by default) load its checkpoint."""
    logger.info("%s: %s implementation", model_config.architecture, model_config.model_impl)
    if model_config.model_impl == "transformers":
        from tokenos.models.transformers_backend import TransformersCausalLM

        return TransformersCausalLM(model_config)  # transformers loads the checkpoint itself
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        model = model_class(model_config.architecture)(model_config)
    finally:
        torch.set_default_dtype(previous)
    if load:
        load_weights(model, model_config)
        pack_for_inference(model, model_config.quantization)
        release_freed_memory()
    return model.eval()


def release_freed_memory() -> None:
    """Hand the loader's freed buffers (dequantized or unpacked copies, ~80 MB for the embedded model)
    back to the OS: glibc keeps them in its arenas otherwise, and they would count as the process's
    memory for as long as it runs. A no-op where malloc_trim does not exist."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pack_for_inference(model: nn.Module, quantization: str | None = None) -> None:
    """Reorder every packable layer's weights once for the CPU's fast kernels (see layers/linear.py),
    quantizing the dense linears with ``quantization`` "int8" / "int4"."""
    for module in model.modules():
        if hasattr(module, "pack"):
            module.pack(quantization)
