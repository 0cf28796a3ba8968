"""The Llama decoder family: Llama (incl. SmolLM2), Mistral, Qwen2 and Qwen3 on a paged KV cache.

The four differ only in knobs carried by ModelConfig: q/k/v bias (Qwen2), per-head q/k
RMSNorm before rotary (Qwen3), sliding windows (Mistral, Qwen2/3 per layer) and tied
embeddings. Layers load their own weights; ``packed_modules_mapping`` routes checkpoint
q/k/v and gate/up into the fused projections.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.fused_decode import FusedDecodePlan
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, MergedLinear, QKVLinear
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack, pre_norm
from tokenos.models.config import ModelConfig


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, config.attention_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window
        )

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.qk_heads(q, k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v, batch))

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] from the flat projections (Qwen3: each head RMS-normed)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up fused: Llama's MLP, and the shared or dense experts of
    the MoE families."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderMLP(GatedMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)


class DecoderLayer(nn.Module):
    # Scales each sublayer's output before the residual add (Granite's residual_multiplier); None: off.
    output_scale: float | None = None

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config)

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.self_attn(rope, x, batch)
        scale = self.output_scale
        if scale is not None:
            x = x * scale
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x if scale is None else x * scale), residual


class DecoderModel(DecoderStack):
    """``layer_cls`` and ``rotary_dim`` (partial rotary) let the Llama-like families (OLMo 2, Phi-3)
    reuse the stack with their own layers."""

    def __init__(
        self, config: ModelConfig, layer_cls: type[nn.Module] = DecoderLayer, rotary_dim: int | None = None
    ) -> None:
        embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling, rotary_dim
        )
        super().__init__(
            ("embed_tokens", embed),
            [layer_cls(config, rotary, window) for window in config.layer_sliding_windows],
            ("norm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )
        self._fused: FusedDecodePlan | None | bool = False  # False: not planned yet (after LoRA attaches)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self._fused is False:
            self._fused = FusedDecodePlan.build(self)
        if self._fused is not None and self._fused.takes(batch):
            x, residual = self._fused.run(self.embed(batch.input_ids), batch)
            return self.norm(x, residual)[0]
        return super().forward(batch)


class LlamaForCausalLM(CausalLM):
    """Llama / SmolLM2 / Mistral / Qwen2 / Qwen3: the variant is chosen by ModelConfig's knobs."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", DecoderModel(config))
