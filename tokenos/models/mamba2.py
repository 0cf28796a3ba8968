"""Mamba2ForCausalLM: a stack of ``RMSNorm -> Mamba2 mixer`` blocks with residuals, no attention.

Every layer is recurrent, so the whole model's state is one fixed-size page per layer per request; it
still takes the hybrid interface (``HybridMetadata``, one state-pool list per layer in ``kv_caches``) so
the worker drives it exactly like an attention + Mamba hybrid. Parameter names equal transformers'
(``backbone.layers.{i}.mixer.in_proj.weight`` ...), so the checkpoint loads by name.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.core.kv_cache.spec import KVCacheSpec
from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.short_conv import RecurrentBatch
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import (
    HybridMetadata,
    check_layer_caches,
    hf_attrs,
    kv_cache_spec_of,
    run_recurrent,
)


class Mamba2Block(nn.Module):
    def __init__(self, dims: Mamba2Dims, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, eps)
        self.mixer = Mamba2Mixer(dims, params_dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        states: list[torch.Tensor],
        batch: RecurrentBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.norm(x)
        else:
            x, residual = self.norm(x, residual)
        return run_recurrent(self.mixer, x, batch, states), residual


class Mamba2Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dims = Mamba2Dims.from_config(hf_attrs(config))
        eps = float(config.hf_config.get("layer_norm_epsilon", config.rms_norm_eps))
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Mamba2Block(dims, eps, config.dtype) for _ in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps)


class Mamba2ForCausalLM(nn.Module):
    """Pure Mamba2 (state-spaces/mamba2, Codestral Mamba layout)."""

    is_hybrid = True  # takes HybridMetadata and per-layer state pools, like the attention hybrids

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = Mamba2Backbone(config)
        tied = self.backbone.embeddings if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def layer_names(self) -> list[str]:
        return [f"backbone.layers.{i}.mixer" for i in range(len(self.backbone.layers))]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: HybridMetadata, kv_caches: list
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]``; ``kv_caches[i]`` = layer i's ``[conv_pool, ssm_pool]``.
        ``positions`` is unused (the state carries position), kept for the common model signature."""
        names = self.layer_names()
        check_layer_caches(names, attn_metadata, kv_caches)
        x, residual = self.backbone.embeddings(input_ids), None
        for name, layer, states in zip(names, self.backbone.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, states, attn_metadata.by_layer[name])
        x, _ = self.backbone.norm_f(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]``; pass only the rows that are sampled."""
        return self.lm_head(hidden)

    def get_kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> dict[str, KVCacheSpec]:
        """One MambaSpec per layer (conv state in the model dtype, SSM state float32)."""
        layers = [
            (name, layer.mixer) for name, layer in zip(self.layer_names(), self.backbone.layers, strict=True)
        ]
        return kv_cache_spec_of(layers, block_size, mamba_cache_mode, self.config.dtype_name)
