"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B) on the Llama decoder.

Attention is `tokenos.models.llama`'s (Qwen2-MoE: q/k/v bias; Qwen3-MoE: per-head q/k RMSNorm, and an
``o_proj`` bias when ``attention_bias``). The feed-forward of layer ``i`` is a sparse MoE block unless ``i``
is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense gated MLP of
``intermediate_size``), as in transformers. The MoE block: router logits (``gate``, no bias) -> softmax in
float32 -> top ``num_experts_per_tok`` probabilities (renormalised to sum 1 if ``norm_topk_prob``) weighting
gated SiLU experts of ``moe_intermediate_size``; Qwen2-MoE adds ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)``.

The experts are held stacked (``[E, 2I, H]`` gate|up, ``[E, H, I]`` down) and computed grouped: the
(token, slot) pairs are sorted by expert, each expert runs one matmul over its rows, and the weighted
outputs are scattered back with one ``index_add_``. Checkpoints store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``); the model's ``packed_modules_mapping`` routes each onto its slot
of the stacked parameter (shard id ``(e, 0 | 1)`` for gate / up, ``e`` for down), so a missing expert is
reported by the loader like any missing shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, _upcast_linear
from tokenos.layers.quantization import ONLINE_METHODS, QuantizedTensor, QuantizedWeight, quantize
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.layers.weights import PackedMapping, WeightHolder, copy_rows, default_weight_loader
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.llama import DecoderAttention, DecoderLayer, GatedMLP
from tokenos.platform import native_bf16_supported


def _expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as `Linear` on its plain path: bf16 is upcast where the CPU only emulates it.
    if x.dtype == torch.bfloat16 and not native_bf16_supported():
        return _upcast_linear(x, weight, None)
    return F.linear(x, weight)


def grouped_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert_fn: Callable[[torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_fn(x[t], chosen[t, k])`` for x [T, H], chosen / weights [T, K], with
    one ``expert_fn(rows, e)`` call per expert that has rows (no loop per token)."""
    top_k = chosen.shape[1]
    # Sort the T*K (token, slot) pairs by expert so each expert's rows are one contiguous group.
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x[tokens]
    outs = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        outs.append(expert_fn(rows[start : start + count], expert))
        start += count
    if not outs:
        return torch.zeros_like(x)
    expert_out = torch.cat(outs) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, expert_out)


class StackedExperts(nn.Module):
    """``num_experts`` gated SiLU MLPs as two stacked weights, loaded one checkpoint expert at a time."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = WeightHolder((num_experts, 2 * intermediate_size, hidden_size), None, dtype)
        self.down_proj = WeightHolder((num_experts, hidden_size, intermediate_size), None, dtype)
        gate_up, down = self.gate_up_proj.weight, self.down_proj.weight
        gate_up.weight_loader, down.weight_loader = self._load_gate_up, self._load_down
        # Per expert, once quantized at load (`pack`): name -> [expert] -> its weight.
        self.quantized: dict[str, list[QuantizedWeight]] = {}
        # Quantized checkpoint shards (a GGUF's expert blocks) until `pack`: name -> shard id -> tensor.
        self._pending: dict[str, dict[int | tuple[int, int], QuantizedTensor]] = {}
        # Every slot must be filled: `missing_weights` compares the shards loaded with these.
        gate_up.shard_ids = tuple((e, half) for e in range(num_experts) for half in (0, 1))
        down.shard_ids = tuple(range(num_experts))

    def _load_gate_up(
        self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id: tuple[int, int]
    ) -> None:
        expert, half = shard_id
        if isinstance(loaded, QuantizedTensor):
            self._hold("gate_up_proj", shard_id, loaded, (self.intermediate_size, param.shape[2]))
            return
        copy_rows(param.data[expert], loaded, half * self.intermediate_size, self.intermediate_size)

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id: int) -> None:
        if isinstance(loaded, QuantizedTensor):
            self._hold("down_proj", shard_id, loaded, tuple(param.shape[1:]))
            return
        default_weight_loader(param.data[shard_id], loaded)

    def _hold(
        self, name: str, shard_id: int | tuple[int, int], loaded: QuantizedTensor, shape: tuple[int, ...]
    ) -> None:
        if tuple(loaded.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(shape)}")
        self._pending.setdefault(name, {})[shard_id] = loaded

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[chosen[t, k]](x[t])`` for x [T, H], chosen / weights [T, K]."""
        return grouped_experts(x, chosen, weights, self.num_experts, self._expert)

    def _expert(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return self._linear(self.act(self._linear(h, "gate_up_proj", expert)), "down_proj", expert)

    @staticmethod
    def act(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _linear(self, h: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized[expert](h)
        return _expert_linear(h, getattr(self, name).weight[expert])

    def pack(self, quantization: str | None = None) -> None:
        """With online int8 / int4 (``--quantization``), every expert's weights quantized like the other
        linears' (rows are independent, so quantizing an expert's fused gate|up is quantizing each), the
        stacked dense copies dropped; otherwise nothing (the experts run ``F.linear``)."""
        if self._pending:
            self._pack_checkpoint_quantized()
        if quantization not in ONLINE_METHODS or self.quantized:
            return
        bits = 8 if quantization == "int8" else 4
        for name in ("gate_up_proj", "down_proj"):
            holder = getattr(self, name)
            self.quantized[name] = [QuantizedWeight(quantize(w, bits)) for w in holder.weight.detach()]
            holder.weight = None

    def _pack_checkpoint_quantized(self) -> None:
        """Run from the checkpoint's quantized experts (gate|up stacked per expert, as `Linear` stacks
        its shards) where every shard of a projection came quantized; a projection that came partly
        dense runs dense, the quantized shards dequantized into it (exact, at the dense size)."""
        pending, self._pending = self._pending, {}
        for name, shards in pending.items():
            holder = getattr(self, name)
            if set(shards) == set(holder.weight.shard_ids):
                per_expert = [
                    [shards[(e, 0)], shards[(e, 1)]] if name == "gate_up_proj" else [shards[e]]
                    for e in range(self.num_experts)
                ]
                self.quantized[name] = [QuantizedWeight(QuantizedTensor.cat(parts)) for parts in per_expert]
                holder.weight = None
                continue
            loader = holder.weight.weight_loader
            for shard_id, t in shards.items():
                loader(holder.weight, t.dequantize(), shard_id)


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in ``dtype``, experts [T, K]): the top-k of a float32 softmax, as transformers does."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), chosen


class QwenSparseMoe(nn.Module):
    """Router, stacked experts and (Qwen2-MoE) a sigmoid-gated shared expert."""

    def __init__(self, config: ModelConfig, shared_expert: bool) -> None:
        super().__init__()
        cfg, hidden = config.hf_config, config.hidden_size
        experts = num_experts(config)
        self.top_k = int(cfg["num_experts_per_tok"])
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
        self.gate = Linear(hidden, experts)
        self.experts = StackedExperts(experts, hidden, int(cfg["moe_intermediate_size"]), config.dtype)
        if shared_expert:
            self.shared_expert = GatedMLP(hidden, int(cfg["shared_expert_intermediate_size"]))
            self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.gate(x), self.top_k, self.norm_topk_prob, x.dtype)
        out = self.experts(x, chosen, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def num_experts(config: ModelConfig) -> int:
    """Released configs say ``num_experts``; transformers 5 saves Qwen3-MoE's as ``num_local_experts``."""
    cfg = config.hf_config
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def uses_moe(config: ModelConfig, layer: int) -> bool:
    """transformers' rule: not in ``mlp_only_layers``, experts configured, and on the sparse step."""
    cfg = config.hf_config
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return (
        layer not in (cfg.get("mlp_only_layers") or [])
        and num_experts(config) > 0
        and (layer + 1) % step == 0
    )


class QwenMoeDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer (its ``forward``) with a sparse MoE or a dense MLP as ``mlp``."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        layer: int,
        shared_expert: bool,
        o_proj_bias: bool,
    ) -> None:
        # Not DecoderLayer.__init__: it would allocate a dense MLP of intermediate_size that MoE layers lack.
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary, sliding_window)
        if o_proj_bias:  # Qwen3-MoE's attention_bias covers o_proj too (Qwen2-MoE's qkv_bias does not)
            self.self_attn.o_proj = Linear(self.self_attn.o_proj.weight.shape[1], config.hidden_size, True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if uses_moe(config, layer):
            self.mlp: nn.Module = QwenSparseMoe(config, shared_expert)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class QwenMoeModel(DecoderStack):
    def __init__(self, config: ModelConfig, shared_expert: bool, o_proj_bias: bool) -> None:
        act = config.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported ({config.architecture}: only silu)")
        embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        layers = [
            QwenMoeDecoderLayer(config, rotary, window, i, shared_expert, o_proj_bias)
            for i, window in enumerate(config.layer_sliding_windows)
        ]
        super().__init__(
            ("embed_tokens", embed),
            layers,
            ("norm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


def expert_mapping(count: int) -> PackedMapping:
    """Checkpoint ``experts.{e}.gate_proj / up_proj / down_proj`` -> the stacked parameters, slot by slot.
    Listed before FUSED_QKV_GATE_UP: `resolve_packed` takes the first match, and a plain "gate_proj" entry
    would otherwise claim the experts' names too."""
    mapping: PackedMapping = {}
    for e in range(count):
        mapping[f"experts.{e}.gate_proj"] = ("experts.gate_up_proj", (e, 0))  # type: ignore[assignment]
        mapping[f"experts.{e}.up_proj"] = ("experts.gate_up_proj", (e, 1))  # type: ignore[assignment]
        mapping[f"experts.{e}.down_proj"] = ("experts.down_proj", e)
    return mapping


class _QwenMoeForCausalLM(CausalLM):
    shared_expert = False
    o_proj_bias_from_attention_bias = False

    def __init__(self, config: ModelConfig) -> None:
        o_proj_bias = self.o_proj_bias_from_attention_bias and config.attention_bias
        super().__init__(config, "model", QwenMoeModel(config, self.shared_expert, o_proj_bias))
        # Per instance: the expert entries depend on this checkpoint's number of experts.
        self.packed_modules_mapping = {**expert_mapping(num_experts(config)), **FUSED_QKV_GATE_UP}


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    """Qwen2-MoE: q/k/v bias (``qkv_bias``), experts beside a sigmoid-gated shared expert."""

    shared_expert = True


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    """Qwen3-MoE: per-head q/k RMSNorm, no shared expert."""

    o_proj_bias_from_attention_bias = True
