"""Pieces every hybrid (attention + recurrent) model shares: the decoder layer, config access, rotary.

Idea: a hybrid model is a stack of layers whose mixer is either full attention or a recurrent layer
(Mamba2, gated DeltaNet). Both kinds are cache layers, so the model itself is an ordinary `CausalLM`: the
worker's `ForwardBatch` hands each mixer its own pool entry (an attention page tensor, or a recurrent
layer's ``[conv_pool, state_pool]``) and its group's metadata.

Block sizes. Every cache layer declares its spec with the same requested ``block_size``; the core's
``get_kv_cache_config`` then raises the attention block size (to a multiple of 16) until one attention page
holds the largest recurrent state, and REPLACES every MambaSpec's block size with that raised attention
block size (padding the recurrent page to the attention page's bytes), unless a checkpoint interval is set.
The worker therefore reads block sizes from the resulting ``KVCacheConfig``, never from what it asked for.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import pre_norm
from tokenos.models.config import ModelConfig


def hf_attrs(config: ModelConfig) -> SimpleNamespace:
    """The raw HF config as attributes (what the recurrent layers' ``Dims.from_config`` read)."""
    return SimpleNamespace(**{k: _decode_floats(v) for k, v in config.hf_config.items()})


def _decode_floats(value: Any) -> Any:
    """transformers writes non-finite floats as ``{"__float__": "Infinity"}`` (``time_step_limit``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def partial_rotary_dim(config: ModelConfig) -> int:
    """Rotated dims per head: ``head_dim * partial_rotary_factor`` (rope_parameters or top level)."""
    cfg: dict[str, Any] = config.hf_config
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    dim = int(config.head_dim * factor)
    if dim % 2 or dim < 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives an odd rotary dim {dim} for head_dim {config.head_dim}"
        )
    return dim


def partial_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The rotary of a hybrid's attention: RoPE on the first ``partial_rotary_dim`` dims of each head."""
    return RotaryEmbedding(
        config.head_dim,
        config.max_model_len,
        config.rope_theta,
        config.rope_scaling,
        rotary_dim=partial_rotary_dim(config),
    )


class HybridDecoderLayer(nn.Module):
    """``input_layernorm -> mixer -> + -> post-mixer norm -> MLP -> +``, the mixer being full attention
    (``self_attn``) or a recurrent layer. Subclasses register their modules under the checkpoint's names
    and give the recurrent mixer's, the post-mixer norm's and the MLP's names."""

    recurrent_name: str
    post_norm_name: str
    mlp_name: str

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = pre_norm(self.input_layernorm, x, residual)
        if self.kind == "full_attention":
            x = self.self_attn(rope, x, batch)
        else:
            x = getattr(self, self.recurrent_name)(x, batch)
        x, residual = getattr(self, self.post_norm_name)(x, residual)
        return getattr(self, self.mlp_name)(x), residual
