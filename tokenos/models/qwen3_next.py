"""Qwen3NextForCausalLM: gated DeltaNet layers interleaved with gated full attention, MoE feed-forward.

Per layer (``layer_types``): a gated DeltaNet (``linear_attn``, recurrent state) or a gated attention
(``self_attn``: q/k RMSNorm per head, partial rotary, ``o_proj(attn * sigmoid(gate))`` with the gate
interleaved per head in ``q_proj``), then a sparse MoE block (softmax top-k router, experts, plus a
sigmoid-gated shared expert) or a dense MLP. Every RMSNorm outside the DeltaNet stores ``weight - 1``
(``(1 + w) * norm(x)``); we add the 1 once at load time. The MoE is computed plainly, one expert at a time
over the tokens routed to it: clear and exact on CPU, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.core.kv_cache.spec import KVCacheSpec
from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention, AttentionMetadata
from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.gated_delta import GatedDeltaDims, GatedDeltaNet
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, MergedLinear, QKVLinear
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


def _plus_one_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"Checkpoint tensor of shape {tuple(loaded.shape)} for parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded.float() + 1.0)


def offset_rms_norm(size: int, eps: float) -> RMSNorm:
    """An RMSNorm whose checkpoint weight is ``w - 1`` (Qwen3-Next's zero-centred norms)."""
    norm = RMSNorm(size, eps)
    norm.weight.weight_loader = _plus_one_loader
    return norm


class Qwen3NextAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: PartialRotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        # q_proj holds [q_h, gate_h] per head, so it is twice as wide as the heads.
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, 2 * self.num_heads, self.num_kv_heads, bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = offset_rms_norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = offset_rms_norm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, rope: Rope, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        p = self.qkv_proj
        q_gate, k, v = self.qkv_proj(x).split([p.q_size, p.kv_size, p.kv_size], -1)
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(rope, q, k)
        out = self.attn(q.contiguous(), k, v.view(n, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class Qwen3NextMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3NextSparseMoe(nn.Module):
    """Top-k softmax routing over ``experts`` plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.hf_config
        self.top_k = int(cfg["num_experts_per_tok"])
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        hidden, num_experts = config.hidden_size, int(cfg["num_experts"])
        self.gate = Linear(hidden, num_experts)
        self.experts = nn.ModuleList(
            Qwen3NextMLP(hidden, int(cfg["moe_intermediate_size"])) for _ in range(num_experts)
        )
        self.shared_expert = Qwen3NextMLP(hidden, int(cfg["shared_expert_intermediate_size"]))
        self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            tokens, slot = torch.where(chosen == e)
            out.index_add_(0, tokens, self.experts[e](x[tokens]) * weights[tokens, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def uses_moe(config: ModelConfig, layer: int) -> bool:
    cfg = config.hf_config
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return (
        layer not in (cfg.get("mlp_only_layers") or [])
        and int(cfg.get("num_experts", 0)) > 0
        and (layer + 1) % step == 0
    )


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, kind: str, rotary: PartialRotary, dims: GatedDeltaDims
    ) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = offset_rms_norm(config.hidden_size, config.rms_norm_eps)
        if kind == "full_attention":
            self.self_attn = Qwen3NextAttention(config, rotary)
        else:
            self.linear_attn = GatedDeltaNet(dims, params_dtype=config.dtype)
        self.post_attention_layernorm = offset_rms_norm(config.hidden_size, config.rms_norm_eps)
        if uses_moe(config, layer):
            self.mlp = Qwen3NextSparseMoe(config)
        else:
            self.mlp = Qwen3NextMLP(config.hidden_size, config.intermediate_size)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.kind == "full_attention" else self.linear_attn

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
            x = run_recurrent(self.linear_attn, x, meta, cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        kinds = config.hf_config.get("layer_types") or []
        if len(kinds) != config.num_hidden_layers:
            raise ValueError(f"Qwen3-Next config needs layer_types with {config.num_hidden_layers} entries")
        dims = GatedDeltaDims.from_config(hf_attrs(config))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = PartialRotary(config)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, kind, self.rotary, dims) for i, kind in enumerate(kinds)
        )
        self.norm = offset_rms_norm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3-Next (e.g. 80B-A3B) layout; multi-token-prediction (``mtp.*``) weights are skipped."""

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
        self.model = Qwen3NextModel(config)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def layer_names(self) -> list[str]:
        return [
            f"model.layers.{i}.{'self_attn' if layer.kind == 'full_attention' else 'linear_attn'}"
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
        x, _ = self.model.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def get_kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> dict[str, KVCacheSpec]:
        """FullAttentionSpec per attention layer, MambaSpec per gated-DeltaNet layer, in layer order."""
        layers = [
            (name, layer.mixer) for name, layer in zip(self.layer_names(), self.model.layers, strict=True)
        ]
        return kv_cache_spec_of(layers, block_size, mamba_cache_mode, self.config.dtype_name)
