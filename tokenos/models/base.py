"""What every causal LM here shares: a decoder stack, an LM head, and the three calls the worker makes.

Idea: a model is ``embeddings -> layers -> final norm`` (a ``DecoderStack``) plus an ``LMHead``, wrapped
in a ``CausalLM`` that the worker drives through ``get_kv_cache_spec(cache_config)``,
``forward(batch: ForwardBatch)`` and ``compute_logits(hidden)``. Every layer takes ``(rope, x, residual,
batch)`` and returns ``(x, residual)``: a pre-norm residual stream, with this step's rotary (cos, sin)
gathered once for all layers (None in a model without rotary). The cache layers inside (attention,
recurrent mixers) are numbered when the model is built and each finds its own cache and metadata in the
batch (the contract is `tokenos.layers.metadata`), so no model maps metadata to layers by hand. Modules
are registered under the checkpoint's names (``model`` / ``backbone``, ``embed_tokens`` / ``embeddings``,
``norm`` / ``final_layernorm`` / ``norm_f``), so weights load by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenos.layers.embedding import LMHead
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.metadata import CacheLayer, ForwardBatch, bind_cache_layers
from tokenos.models.config import ModelConfig

if TYPE_CHECKING:
    from tokenos.config import CacheConfig
    from tokenos.core.kv_cache.spec import KVCacheSpec

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

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed(batch.input_ids), None
        rope = self.rotary.cos_sin(batch.positions, x.dtype) if hasattr(self, "rotary") else None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, batch)
        x, _ = getattr(self, self._norm_name)(x, residual)
        return x


class PagedModel(nn.Module):
    """What the worker asks of any model about its cache: its bound cache layers (``_cache_layers``,
    set by the subclass once its modules exist) and their specs, from ``config``."""

    config: ModelConfig
    _cache_layers: list[tuple[str, CacheLayer]]

    def cache_layers(self) -> list[tuple[str, CacheLayer]]:
        """(module path, layer) of every cache layer, in pool-entry order (``kv_caches`` order)."""
        return list(self._cache_layers)

    def get_kv_cache_spec(self, cache_config: CacheConfig) -> dict[str, KVCacheSpec]:
        """What state each cache layer needs, by module path, in pool-entry order."""
        dtype = self.config.dtype_name
        return {name: layer.get_kv_cache_spec(cache_config, dtype) for name, layer in self._cache_layers}


class CausalLM(PagedModel):
    """A ``DecoderStack`` (registered as ``stack_name``) and an LM head, tied to its embeddings if the
    config says so. Its cache layers are bound (numbered) here, once the stack is built."""

    def __init__(self, config: ModelConfig, stack_name: str, stack: DecoderStack) -> None:
        super().__init__()
        self.config = config
        self._stack_name = stack_name
        self.add_module(stack_name, stack)
        tied = stack.embed if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)
        self._cache_layers = bind_cache_layers(self)

    @property
    def stack(self) -> DecoderStack:
        return getattr(self, self._stack_name)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for one step."""
        return self.stack(batch)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]``; pass only the rows that are sampled."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(1)`` without the logits where the LM head can (a greedy batch
        at 64 rows writes and reads back 12.6 MB of them otherwise); None: compute them. A model whose
        logits are more than the head's products (scaled, soft-capped) always computes them."""
        if type(self).compute_logits is not CausalLM.compute_logits:
            return None
        return self.lm_head.greedy(hidden)
