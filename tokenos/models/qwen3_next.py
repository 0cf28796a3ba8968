"""Qwen3NextForCausalLM: gated DeltaNet layers interleaved with gated full attention, MoE feed-forward.

Per layer (``layer_types``): a gated DeltaNet (``linear_attn``, recurrent state) or a gated attention
(``self_attn``: q/k RMSNorm per head, partial rotary, ``o_proj(attn * sigmoid(gate))`` with the gate
interleaved per head in ``q_proj``), then a sparse MoE block (softmax top-k router, experts, plus a
sigmoid-gated shared expert) or a dense MLP. Every RMSNorm outside the DeltaNet stores ``weight - 1``
(``(1 + w) * norm(x)``); we add the 1 once at load time, in float32 (``OffsetRMSNorm``). The MoE is
computed plainly, one expert at a time over the tokens routed to it: clear and exact on CPU, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.gated_delta import GatedDeltaDims, GatedDeltaNet
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, QKVLinear
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import HybridDecoderLayer, hf_attrs, partial_rotary
from tokenos.models.llama import GatedMLP


class OffsetRMSNorm(RMSNorm):
    """Qwen3-Next's zero-centred RMSNorm: the checkpoint stores ``w``, the scale is ``1 + w``.

    ``w`` is rounded to the model dtype (transformers and vLLM hold it so), then the scale ``1 + w`` is
    formed once, at load time, and kept in float32: rounded to bfloat16 it would lose the low bits of ``w``
    (bf16 spacing is 2^-7 near 1, ~2^-11 near a typical |w| of 0.1), a fixed perturbation of every norm of
    the model. In bfloat16 the norm is computed as transformers does it, ``(norm(x.float()) * (1 + w))
    .to(bf16)``: one rounding, where ``RMSNorm``'s ``w * norm(x).to(bf16)`` rounds twice.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, eps)
        self.model_dtype = dtype
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self._load_plus_one

    def _load_plus_one(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"Checkpoint tensor of shape {tuple(loaded.shape)} for parameter {tuple(param.shape)}"
            )
        param.data.copy_(loaded.to(self.model_dtype).float() + 1.0)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def offset_norm(size: int, config: ModelConfig) -> OffsetRMSNorm:
    return OffsetRMSNorm(size, config.rms_norm_eps, config.dtype)


class Qwen3NextAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        # q_proj holds [q_h, gate_h] per head, so it is twice as wide as the heads.
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, 2 * self.num_heads, self.num_kv_heads, bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = offset_norm(self.head_dim, config)
        self.k_norm = offset_norm(self.head_dim, config)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        p = self.qkv_proj
        q_gate, k, v = self.qkv_proj(x).split([p.q_size, p.kv_size, p.kv_size], -1)
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(rope, q, k)
        out = self.attn(q.contiguous(), k, v.view(n, self.num_kv_heads, self.head_dim), batch)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


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
            GatedMLP(hidden, int(cfg["moe_intermediate_size"])) for _ in range(num_experts)
        )
        self.shared_expert = GatedMLP(hidden, int(cfg["shared_expert_intermediate_size"]))
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


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    recurrent_name, post_norm_name, mlp_name = "linear_attn", "post_attention_layernorm", "mlp"

    def __init__(
        self, config: ModelConfig, layer: int, kind: str, rotary: RotaryEmbedding, dims: GatedDeltaDims
    ) -> None:
        super().__init__(kind)
        self.input_layernorm = offset_norm(config.hidden_size, config)
        if kind == "full_attention":
            self.self_attn = Qwen3NextAttention(config, rotary)
        else:
            self.linear_attn = GatedDeltaNet(dims, params_dtype=config.dtype)
        self.post_attention_layernorm = offset_norm(config.hidden_size, config)
        if uses_moe(config, layer):
            self.mlp = Qwen3NextSparseMoe(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class Qwen3NextModel(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        kinds = config.hf_config.get("layer_types") or []
        if len(kinds) != config.num_hidden_layers:
            raise ValueError(f"Qwen3-Next config needs layer_types with {config.num_hidden_layers} entries")
        dims = GatedDeltaDims.from_config(hf_attrs(config))
        embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = partial_rotary(config)
        super().__init__(
            ("embed_tokens", embed),
            [Qwen3NextDecoderLayer(config, i, kind, rotary, dims) for i, kind in enumerate(kinds)],
            ("norm", offset_norm(config.hidden_size, config)),
            rotary,
        )


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next (e.g. 80B-A3B) layout; its multi-token-prediction (``mtp.*``) weights are not part of it."""

    packed_modules_mapping = FUSED_QKV_GATE_UP
    # Released checkpoints carry a multi-token-prediction layer: with speculative method "mtp" it is
    # built and loaded beside this model (`models/qwen3_next_mtp.py`, `worker/mtp.py`), else unused.
    ignored_weight_prefixes = ("mtp.",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", Qwen3NextModel(config))
