"""Route a checkpoint's (HF name, tensor) stream into a model, parameter by parameter.

Each parameter takes its tensor through its own ``weight_loader`` (see `tokenos.layers.weights`, the one
loading idiom); fused modules (qkv_proj, gate_up_proj) are reached through the model's
``packed_modules_mapping``. We raise if a parameter (or one shard of a fused one) is never loaded, so a
naming mismatch never leaves uninitialised weights behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tokenos.layers.weights import load_named_weights, missing_weights


class CheckpointConfig(Protocol):
    """What loading needs to know of a model's config (`tokenos.models.config.ModelConfig` has it);
    a protocol, so this package stays below the model code."""

    model_path: str
    gguf_file: str | None
    tie_word_embeddings: bool
    num_attention_heads: int
    num_key_value_heads: int
    quantization: str | None


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def iter_checkpoint_weights(config: CheckpointConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under Hugging Face names, whatever the file format."""
    if config.gguf_file:
        from tokenos.model_loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(
            config.model_path,
            config.num_attention_heads,
            config.num_key_value_heads,
            keep_quantized=config.quantization == "gguf",
        )
    from tokenos.model_loader.safetensors_loader import iter_safetensors_weights

    stream = iter_safetensors_weights(config.model_path)
    if config.quantization in ("gptq", "awq"):
        from tokenos.model_loader.gptq_awq import iter_prequantized_weights, read_quantization_config

        return iter_prequantized_weights(stream, read_quantization_config(config.model_path))
    return stream


def load_weights(model: nn.Module, config: CheckpointConfig, weights: Iterable | None = None) -> None:
    """Load ``weights`` (default: the checkpoint of ``config``) into ``model``."""
    # Checkpoint parts the model does not run (e.g. multi-token-prediction heads): skipped by name.
    ignored_prefixes = tuple(getattr(model, "ignored_weight_prefixes", ()))

    def skip(name: str) -> bool:
        return (
            name.endswith(_IGNORED_SUFFIXES)
            or (config.tie_word_embeddings and name.startswith("lm_head."))
            or bool(ignored_prefixes and name.startswith(ignored_prefixes))
        )

    stream = weights if weights is not None else iter_checkpoint_weights(config)
    loaded = load_named_weights(model, stream, getattr(model, "packed_modules_mapping", {}), skip)
    missing = missing_weights(model, loaded)
    if missing:
        raise ValueError(f"Checkpoint {config.model_path} lacks weights for: {', '.join(missing[:8])}")
