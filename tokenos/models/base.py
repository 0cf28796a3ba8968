"""What every causal LM here shares: a decoder stack, an LM head, and the calls the worker makes.

Idea: a model is ``embeddings -> layers -> final norm`` (a ``DecoderStack``) plus an ``LMHead``, wrapped
in a ``CausalLM`` that the worker drives through ``forward(input_ids, positions, attn_metadata,
kv_caches)`` and ``compute_logits(hidden)``. Every layer takes ``(rope, x, residual, cache, meta)`` and
returns ``(x, residual)``: a pre-norm residual stream, with this step's rotary (cos, sin) gathered once for
all layers (None in a model without rotary). Modules are registered under the checkpoint's names
(``model`` / ``backbone``, ``embed_tokens`` / ``embeddings``, ``norm`` / ``final_layernorm`` / ``norm_f``),
so weights load by name. A subclass only says how ``attn_metadata`` maps to one metadata per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenos.layers.embedding import LMHead
from tokenos.layers.layernorm import RMSNorm
from tokenos.models.config import ModelConfig

# Checkpoint q/k/v and gate/up projections -> our fused qkv_proj / gate_up_proj (and their shard ids).
FUSED_QKV_GATE_UP: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def pre_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the first layer (``residual`` None) starts the stream."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class DecoderStack(nn.Module):
    """``embed -> layers -> final norm``; ``embed`` and ``norm`` are ``(checkpoint name, module)`` pairs."""

    def __init__(
        self,
        embed: tuple[str, nn.Module],
        layers: list[nn.Module],
        norm: tuple[str, nn.Module],
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self._embed_name, self._norm_name = embed[0], norm[0]
        self.add_module(*embed)
        if rotary is not None:  # one table, shared (the same module object) by every attention layer
            self.rotary = rotary
        self.layers = nn.ModuleList(layers)
        self.add_module(*norm)

    @property
    def embed(self) -> nn.Module:
        return getattr(self, self._embed_name)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[Any], kv_caches: list
    ) -> torch.Tensor:
        """Layer ``i`` reads ``kv_caches[i]`` with ``metas[i]``."""
        x, residual = self.embed(input_ids), None
        rope = self.rotary.cos_sin(positions, x.dtype) if hasattr(self, "rotary") else None
        for layer, cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            x, residual = layer(rope, x, residual, cache, meta)
        x, _ = getattr(self, self._norm_name)(x, residual)
        return x


class CausalLM(nn.Module):
    """A ``DecoderStack`` (registered as ``stack_name``) and an LM head, tied to its embeddings if the
    config says so. Subclasses implement ``layer_metadata`` and ``get_kv_cache_spec``."""

    def __init__(self, config: ModelConfig, stack_name: str, stack: DecoderStack) -> None:
        super().__init__()
        self.config = config
        self._stack_name = stack_name
        self.add_module(stack_name, stack)
        tied = stack.embed if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    @property
    def stack(self) -> DecoderStack:
        return getattr(self, self._stack_name)

    def layer_metadata(self, attn_metadata: Any, kv_caches: list) -> list[Any]:
        """One metadata per layer (in ``kv_caches`` order) from what the worker passed."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any, kv_caches: list
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for a step; layer i reads ``kv_caches[i]``."""
        metas = self.layer_metadata(attn_metadata, kv_caches)
        return self.stack(input_ids, positions, metas, kv_caches)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]``; pass only the rows that are sampled."""
        return self.lm_head(hidden)
