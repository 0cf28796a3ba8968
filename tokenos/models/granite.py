"""Granite (dense): the Llama decoder with IBM's muP multipliers.

``embedding_multiplier`` scales the embeddings, ``attention_multiplier`` is the softmax scale (instead of
``head_dim ** -0.5``), ``residual_multiplier`` scales each sublayer's output before it joins the residual
stream and the logits are divided by ``logits_scaling``. The scaled embedding is
`tokenos.models.granitemoehybrid`'s; everything else is `tokenos.models.llama`'s.
"""

from __future__ import annotations

import torch

from tokenos.layers.attention import Attention
from tokenos.layers.linear import Linear
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM
from tokenos.models.config import ModelConfig
from tokenos.models.granitemoehybrid import ScaledEmbedding
from tokenos.models.llama import DecoderAttention, DecoderLayer, DecoderModel


class GraniteAttention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary, sliding_window)
        scale = float(config.hf_config.get("attention_multiplier", self.head_dim**-0.5))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window)
        if config.attention_bias:  # Granite's attention_bias covers o_proj too (Qwen2's only q/k/v)
            self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=True)


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary, sliding_window)
        self.self_attn = GraniteAttention(config, rotary, sliding_window)
        self.output_scale = float(config.hf_config.get("residual_multiplier", 1.0))


def _check_supported(config: ModelConfig) -> None:
    cfg = config.hf_config
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Granite: only silu)")
    if cfg.get("mlp_bias", False):
        raise ValueError("Granite: mlp_bias=True is not supported yet")


class GraniteForCausalLM(CausalLM):
    """IBM Granite 3.x dense (``GraniteConfig``)."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        _check_supported(config)
        stack = DecoderModel(config, GraniteDecoderLayer)
        multiplier = float(config.hf_config.get("embedding_multiplier", 1.0))
        stack.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, multiplier)
        super().__init__(config, "model", stack)
        self.logits_scaling = float(config.hf_config.get("logits_scaling", 1.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
