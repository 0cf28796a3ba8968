"""BambaForCausalLM: Mamba2 layers with a few full-attention layers (partial rotary), each followed by an MLP.

Layer ``i`` is attention if ``i`` is in ``attn_layer_indices``, else a Mamba2 mixer; both sit in the same
pre-norm residual block (``input_layernorm -> mixer -> + -> pre_ff_layernorm -> MLP -> +``). Attention
layers own a page tensor, Mamba layers a ``[conv_pool, ssm_pool]`` pair; the worker maps both through
``HybridMetadata`` (see ``tokenos.models.hybrid``). Parameter names equal transformers', with q/k/v and
gate/up fused through ``packed_modules_mapping``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.core.kv_cache.spec import KVCacheSpec
from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention, AttentionMetadata
from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, MergedLinear, QKVLinear
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import (
    HybridMetadata,
    PartialRotary,
    Rope,
    check_layer_caches,
    hf_attrs,
    kv_cache_spec_of,
    run_recurrent,
)


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
    def __init__(self, config: ModelConfig, rotary: PartialRotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1
        )
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, meta))


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


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, rotary: PartialRotary, dims: Mamba2Dims) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "full_attention":
            self.self_attn = BambaAttention(config, rotary)
        else:
            self.mamba = Mamba2Mixer(dims, params_dtype=config.dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = BambaMLP(config)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.kind == "full_attention" else self.mamba

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, cache, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.kind == "full_attention":
            x = self.self_attn(rope, x, cache, meta)
        else:
            x = run_recurrent(self.mamba, x, meta, cache)
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class BambaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dims = Mamba2Dims.from_config(hf_attrs(config))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = PartialRotary(config)  # one table, shared by every attention layer
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, kind, self.rotary, dims) for kind in layer_types(config)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class BambaForCausalLM(nn.Module):
    """IBM Bamba: Mamba2 + full attention hybrid."""

    is_hybrid = True
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = BambaModel(config)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def layer_names(self) -> list[str]:
        return [
            f"model.layers.{i}.{'self_attn' if layer.kind == 'full_attention' else 'mamba'}"
            for i, layer in enumerate(self.model.layers)
        ]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: HybridMetadata, kv_caches: list
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]``; layer i reads ``kv_caches[i]`` (spec order)."""
        names = self.layer_names()
        check_layer_caches(names, attn_metadata, kv_caches)
        x, residual = self.model.embed_tokens(input_ids), None
        rope = self.model.rotary.cos_sin(positions, x.dtype)
        for name, layer, cache in zip(names, self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, cache, attn_metadata.by_layer[name])
        x, _ = self.model.final_layernorm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def get_kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> dict[str, KVCacheSpec]:
        """FullAttentionSpec per attention layer, MambaSpec per Mamba layer, in layer order."""
        layers = [
            (name, layer.mixer) for name, layer in zip(self.layer_names(), self.model.layers, strict=True)
        ]
        return kv_cache_spec_of(layers, block_size, mamba_cache_mode, self.config.dtype_name)
