"""DeepSeek V2 (V2, V2-Lite) and V3 (V3, R1): multi-head latent attention, a routed MoE with shared experts.

Attention (`tokenos.layers.mla`): the query comes from ``q_proj`` (``q_lora_rank`` null: V2-Lite) or the
low-rank ``q_b_proj(q_a_layernorm(q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives the latent (normed by
``kv_a_layernorm``) and one rope key shared by every head; only those two are cached. The rope dims are
interleaved pairs (V2 always, V3 unless ``rope_interleave`` is false): we de-interleave q_pe and k_pe
before the ordinary rotate-half rotation, which is transformers' ``apply_rotary_pos_emb_interleave``
exactly, and for V2's complex rotation the same products in another order of the (q, k) dims, which
every dot product ignores. The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale(factor,
mscale_all_dim) ** 2`` when a rope scaling sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``).
The q_a / kv_a norms use eps 1e-6 whatever ``rms_norm_eps`` says, as transformers builds them.

Feed-forward: layers below ``first_k_dense_replace`` are a dense gated MLP of ``intermediate_size``, the
rest a MoE: ``n_routed_experts`` experts of ``moe_intermediate_size`` (stacked, `qwen_moe.StackedExperts`)
plus ``n_shared_experts`` fused into one MLP added to every token. The router (``gate``, float32 weight,
float32 logits) is V2's softmax with ``topk_method`` greedy or group_limited_greedy (the best
``topk_group`` of ``n_group`` groups by their best expert), weights times ``routed_scaling_factor``; or
V3's noaux_tc: sigmoid scores, ``e_score_correction_bias`` added for the choice only, groups ranked by
their top-2 sum, the chosen experts' unbiased scores renormalised if ``norm_topk_prob``, times the
scaling factor. Config values transformers would run differently from the released code are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.mla import MLAAttention
from tokenos.layers.rotary import Rope, RotaryEmbedding, rope_type_of
from tokenos.layers.weights import PackedMapping, WeightHolder, make_param
from tokenos.models.base import CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.llama import DecoderLayer, GatedMLP
from tokenos.models.qwen_moe import StackedExperts, expert_mapping

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm's default eps.
LATENT_NORM_EPS = 1e-6
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
GATE_UP: PackedMapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` for a scaled rope with ``mscale_all_dim``."""
    scale = (int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])) ** -0.5
    if scaling and rope_type_of(scaling) != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class InterleavedRotary(RotaryEmbedding):
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ...: de-interleaved first, then rotate-half."""

    def forward(self, rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(rope, _deinterleave(q), _deinterleave(k))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        cfg, hidden = config.hf_config, config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        self.v_head_dim, self.kv_lora_rank = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
        qk_head_dim, bias = self.nope + self.rope_dim, config.attention_bias
        q_lora_rank = cfg.get("q_lora_rank")
        if q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, int(q_lora_rank), bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = Linear(int(q_lora_rank), self.num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        # Not a packed `Linear`: decodes read its weight per head (absorbed), prefills expand with it.
        self.kv_b_proj = WeightHolder(
            (self.num_heads * (self.nope + self.v_head_dim), self.kv_lora_rank), None, config.dtype
        )
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias)
        self.rotary = rotary
        scale = softmax_scale(cfg, config.rope_scaling)
        self.attn = MLAAttention(
            self.num_heads,
            self.nope,
            self.rope_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            scale,
            self.kv_b_proj,
        )

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], -1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary(rope, q_pe, k_pe.reshape(-1, 1, self.rope_dim))
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.o_proj(self.attn(q, latent, k_pe.reshape(-1, self.rope_dim), batch))


def route_softmax(
    logits: torch.Tensor, top_k: int, method: str, n_group: int | None, topk_group: int | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V2's router (float32): softmax scores, top-k over all experts (greedy) or over the best
    ``topk_group`` groups by their best expert (group_limited_greedy), weights times ``scaling``."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], n_group, -1)
        best = torch.topk(grouped.max(dim=-1).values, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, best, True)
        scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1), 0.0)
    weights, chosen = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, chosen


def route_noaux_tc(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V3's router (float32): sigmoid scores; the bias steers the choice only (groups ranked by the
    sum of their two best biased scores, the best ``topk_group`` kept, top-k inside them); the weights are
    the chosen experts' unbiased scores, renormalised if asked, times ``scaling``."""
    scores = logits.sigmoid()
    choice = scores + bias
    grouped = choice.view(choice.shape[0], n_group, -1)
    best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
    chosen = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


class DeepseekRouter(nn.Module):
    """``gate``: a float32 [E, hidden] weight (and V3's float32 ``e_score_correction_bias``)."""

    def __init__(self, config: ModelConfig, v3: bool) -> None:
        super().__init__()
        cfg = config.hf_config
        self.v3 = v3
        self.num_experts, self.top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
        self.n_group, self.topk_group = cfg.get("n_group"), cfg.get("topk_group")
        self.method = "noaux_tc" if v3 else cfg.get("topk_method") or "greedy"
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob"))
        self.scaling = float(cfg.get("routed_scaling_factor", 1.0))
        self.weight = make_param(self.num_experts, config.hidden_size, dtype=torch.float32)
        if v3:
            self.e_score_correction_bias = make_param(self.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] float32, experts [T, K])."""
        logits = F.linear(x.float(), self.weight)
        if self.v3:
            return route_noaux_tc(
                logits,
                self.e_score_correction_bias,
                self.top_k,
                self.n_group,
                self.topk_group,
                self.norm_topk_prob,
                self.scaling,
            )
        return route_softmax(logits, self.top_k, self.method, self.n_group, self.topk_group, self.scaling)


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, v3: bool) -> None:
        super().__init__()
        cfg, hidden = config.hf_config, config.hidden_size
        size = int(cfg["moe_intermediate_size"])
        self.gate = DeepseekRouter(config, v3)
        self.experts = StackedExperts(self.gate.num_experts, hidden, size, config.dtype)
        shared = int(cfg.get("n_shared_experts") or 0)
        if shared:
            self.shared_experts = GatedMLP(hidden, size * shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = self.experts(x, chosen, weights.to(x.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer (its ``forward``) with MLA and a dense MLP or the MoE."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: int, v3: bool) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's: its attention and MLP are Llama's
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer >= int(config.hf_config.get("first_k_dense_replace") or 0):
            self.mlp: nn.Module = DeepseekMoE(config, v3)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


def check_config(config: ModelConfig, v3: bool) -> None:
    """Refuse, by name, what we would not run exactly as transformers and the released code do."""
    cfg = config.hf_config

    def refuse(what: str) -> None:
        raise ValueError(f"{config.architecture}: {what} is not supported")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias=true")
    if config.num_key_value_heads != config.num_attention_heads:
        refuse(f"num_key_value_heads {config.num_key_value_heads} != num_attention_heads (MLA has no GQA)")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        # transformers ignores it (every layer from first_k_dense_replace on is MoE); the released code not.
        refuse(f"moe_layer_freq {cfg['moe_layer_freq']}")
    if not cfg.get("n_routed_experts"):
        refuse("a config without n_routed_experts")
    scoring, method = cfg.get("scoring_func"), cfg.get("topk_method")
    if v3:
        if scoring not in (None, "sigmoid"):
            refuse(f"scoring_func {scoring!r} (DeepSeek V3: sigmoid)")
        if method not in (None, "noaux_tc"):
            refuse(f"topk_method {method!r} (DeepSeek V3: noaux_tc)")
    else:
        if scoring not in (None, "softmax"):
            refuse(f"scoring_func {scoring!r} (DeepSeek V2: softmax)")
        if (method or "greedy") not in V2_TOPK_METHODS:
            refuse(f"topk_method {method!r} (DeepSeek V2: {', '.join(V2_TOPK_METHODS)})")
        if cfg.get("norm_topk_prob"):
            # transformers' V2 router never renormalises; the released code would.
            refuse("norm_topk_prob=true")
    if v3 or method == "group_limited_greedy":
        _check_groups(config, refuse, min_per_group=2 if v3 else 1)


def _check_groups(config: ModelConfig, refuse, min_per_group: int) -> None:
    cfg = config.hf_config
    experts, n_group, topk_group = int(cfg["n_routed_experts"]), cfg.get("n_group"), cfg.get("topk_group")
    if not n_group or not topk_group or experts % int(n_group) or not 0 < int(topk_group) <= int(n_group):
        refuse(f"n_group={n_group}, topk_group={topk_group} with {experts} routed experts")
    if experts // int(n_group) < min_per_group:
        refuse(f"{experts // int(n_group)} expert(s) per group (grouped top-k ranks a group by its top 2)")


class DeepseekModel(DecoderStack):
    def __init__(self, config: ModelConfig, v3: bool) -> None:
        cfg = config.hf_config
        interleaved = not v3 or cfg.get("rope_interleave", True)
        rotary_cls = InterleavedRotary if interleaved else RotaryEmbedding
        rotary = rotary_cls(
            int(cfg["qk_rope_head_dim"]), config.max_model_len, config.rope_theta, config.rope_scaling
        )
        layers = [DeepseekDecoderLayer(config, rotary, i, v3) for i in range(config.num_hidden_layers)]
        super().__init__(
            ("embed_tokens", VocabEmbedding(config.vocab_size, config.hidden_size)),
            layers,
            ("norm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


class _DeepseekForCausalLM(CausalLM):
    v3 = False

    def __init__(self, config: ModelConfig) -> None:
        check_config(config, self.v3)
        super().__init__(config, "model", DeepseekModel(config, self.v3))
        self.packed_modules_mapping = {**expert_mapping(int(config.hf_config["n_routed_experts"])), **GATE_UP}
        # V3 checkpoints carry their multi-token-prediction layers after the last decoder layer.
        num_mtp = int(config.hf_config.get("num_nextn_predict_layers") or 0)
        first = config.num_hidden_layers
        self.ignored_weight_prefixes = tuple(f"model.layers.{first + i}." for i in range(num_mtp))


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V2 / V2-Lite / V2.5 / Coder-V2: softmax routing (greedy or group-limited)."""


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    """DeepSeek-V3 / R1: sigmoid noaux_tc grouped routing with a score-correction bias."""

    v3 = True
