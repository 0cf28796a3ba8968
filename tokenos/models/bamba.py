"""BambaForCausalLM: Mamba2 layers with a few full-attention layers (partial rotary), each followed by an MLP.

Layer ``i`` is attention if ``i`` is in ``attn_layer_indices``, else a Mamba2 mixer; both sit in the same
pre-norm residual block (``input_layernorm -> mixer -> + -> pre_ff_layernorm -> MLP -> +``). Attention
layers own a page tensor, Mamba layers a ``[conv_pool, ssm_pool]`` pair; each finds its own in the step's
``ForwardBatch`` (see ``tokenos.layers.metadata``). Parameter names equal transformers', with q/k/v and
gate/up fused through ``packed_modules_mapping``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, MergedLinear, QKVLinear
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import HybridDecoderLayer, hf_attrs, partial_rotary


def layer_types(config: ModelConfig) -> list[str]:
    """ "full_attention" / "linear_attention" per layer (from ``attn_layer_indices`` or ``layer_types``)."""
    cfg = config.hf_config
    explicit = cfg.get("layers_block_type") or cfg.get("layer_types")
    if explicit:
        return [
            "full_attention" if t in ("attention", "full_attention") else "linear_attention" for t in explicit
        ]
    attn = set(cfg.get("attn_layer_indices") or [])
    return ["full_attention" if i in attn else "linear_attention" for i in range(config.num_hidden_layers)]


class BambaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1
        )
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), batch))


class BambaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = bool(config.hf_config.get("mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias)
        self.down_proj = Linear(size, config.hidden_size, bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class BambaDecoderLayer(HybridDecoderLayer):
    recurrent_name, post_norm_name, mlp_name = "mamba", "pre_ff_layernorm", "feed_forward"

    def __init__(self, config: ModelConfig, kind: str, rotary: RotaryEmbedding, dims: Mamba2Dims) -> None:
        super().__init__(kind)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "full_attention":
            self.self_attn = BambaAttention(config, rotary)
        else:
            self.mamba = Mamba2Mixer(dims, params_dtype=config.dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = BambaMLP(config)


class BambaModel(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        dims = Mamba2Dims.from_config(hf_attrs(config))
        embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = partial_rotary(config)
        super().__init__(
            ("embed_tokens", embed),
            [BambaDecoderLayer(config, kind, rotary, dims) for kind in layer_types(config)],
            ("final_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


class BambaForCausalLM(CausalLM):
    """IBM Bamba: Mamba2 + full attention hybrid."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", BambaModel(config))
