"""Mamba2ForCausalLM: a stack of ``RMSNorm -> Mamba2 mixer`` blocks with residuals, no attention.

Every layer is recurrent, so the whole model's state is one fixed-size page per layer per request;
the worker drives it exactly like an attention + Mamba hybrid (each mixer is a cache layer). Parameter
names equal transformers' (``backbone.layers.{i}.mixer.in_proj.weight`` ...), so the checkpoint loads by
name.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.metadata import ForwardBatch
from tokenos.models.base import CausalLM, DecoderStack, pre_norm
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import hf_attrs


class Mamba2Block(nn.Module):
    def __init__(self, dims: Mamba2Dims, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(dims.hidden_size, eps)
        self.mixer = Mamba2Mixer(dims, params_dtype=dtype)

    def forward(
        self,
        rope: None,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope`` is always None (no attention; the state carries position), kept for the stack's call."""
        x, residual = pre_norm(self.norm, x, residual)
        return self.mixer(x, batch), residual


class Mamba2Backbone(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        dims = Mamba2Dims.from_config(hf_attrs(config))
        eps = float(config.hf_config.get("layer_norm_epsilon", config.rms_norm_eps))
        super().__init__(
            ("embeddings", VocabEmbedding(config.vocab_size, config.hidden_size)),
            [Mamba2Block(dims, eps, config.dtype) for _ in range(config.num_hidden_layers)],
            ("norm_f", RMSNorm(config.hidden_size, eps)),
        )


class Mamba2ForCausalLM(CausalLM):
    """Pure Mamba2 (state-spaces/mamba2, Codestral Mamba layout): one ``[conv_pool, ssm_pool]`` entry per
    layer, like the recurrent layers of the attention hybrids."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "backbone", Mamba2Backbone(config))
