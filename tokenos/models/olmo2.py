"""OLMo 2: the Llama decoder with post-norms and q/k RMSNorm over the whole projections.

Each sublayer's output is RMS-normed before it joins the residual stream (``post_attention_layernorm``,
``post_feedforward_layernorm``; no pre-norms), and q / k are normed over all heads at once (one weight of
``heads * head_dim``) before rotary. Everything else is `tokenos.models.llama`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM
from tokenos.models.config import ModelConfig
from tokenos.models.llama import DecoderAttention, DecoderMLP, DecoderModel


class Olmo2Attention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary, sliding_window)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The stream arrives as (last sublayer's normed output, residual); the final norm adds them too.
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(rope, h, batch))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(CausalLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", DecoderModel(config, Olmo2DecoderLayer))
