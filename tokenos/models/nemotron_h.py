"""NemotronHForCausalLM (NVIDIA Nemotron-H, Nemotron 3 Nano): a stack of single-mixer residual blocks.

Every block is ``x + mixer(norm(x))`` with ONE mixer, chosen per layer by ``layers_block_type`` (or the
older ``hybrid_override_pattern``: "M" Mamba2, "*" attention, "-" MLP, "E" MoE). Attention has no rotary
(the Mamba layers carry order) and no biases; the MLP is ``down(relu(up(x))^2)`` with no gate; the MoE
routes DeepSeek-style (sigmoid scores, a correction bias for the choice only, the best ``topk_group`` of
``n_group`` expert groups, weights renormalised and times ``routed_scaling_factor``) over ungated relu2
experts, computed plainly one expert at a time, plus shared experts.

Only Mamba and attention blocks hold a cache (their mixers are cache layers); MLP and MoE blocks have none,
so pool entry j is the j-th cache-holding block. Module names equal the checkpoint's
(``backbone.layers.i.mixer...``, one ``experts.j`` module per expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import NoRotary, Rope
from tokenos.layers.weights import make_param
from tokenos.models.bamba import BambaAttention
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack, pre_norm
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import hf_attrs

PATTERN_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


def block_kinds(config: ModelConfig) -> list[str]:
    """Each layer's mixer kind, from ``layers_block_type`` or ``hybrid_override_pattern``."""
    cfg = config.hf_config
    kinds = cfg.get("layers_block_type") or [
        PATTERN_KINDS.get(c, c) for c in cfg.get("hybrid_override_pattern", "")
    ]
    kinds = [LEGACY_KINDS.get(k, k) for k in kinds]
    unknown = set(kinds) - set(PATTERN_KINDS.values())
    if not kinds or unknown:
        raise ValueError(
            f"NemotronH needs layers_block_type or hybrid_override_pattern ('M*-E'); unknown kinds {unknown}"
        )
    return kinds


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm whose weight multiply stays in float32, rounding once (transformers' NemotronHRMSNorm)."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class NemotronHMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``: no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHRouter(nn.Module):
    """Sigmoid router with grouped top-k; weight and correction bias kept float32 (as transformers does)."""

    def __init__(self, hidden_size: int, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.num_experts = int(cfg["n_routed_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.n_group, self.topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.scaling = float(cfg.get("routed_scaling_factor", 1.0))
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ValueError(f"{self.num_experts} experts do not split into {self.n_group} groups of >= 2")
        self.weight = make_param(self.num_experts, hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = make_param(self.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights ``[T, top_k]``, expert ids ``[T, top_k]``)."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        chosen = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class NemotronHMoE(nn.Module):
    """Routed relu2 experts (optionally in a ``moe_latent_size`` space) plus the shared experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg, hidden = config.hf_config, config.hidden_size
        bias = bool(cfg.get("mlp_bias", False))
        latent = cfg.get("moe_latent_size")
        expert_dim = int(latent) if latent else hidden
        self.gate = NemotronHRouter(hidden, cfg)
        self.experts = nn.ModuleList(
            NemotronHMLP(expert_dim, int(cfg["moe_intermediate_size"])) for _ in range(self.gate.num_experts)
        )
        self.shared_experts = NemotronHMLP(hidden, int(cfg["moe_shared_expert_intermediate_size"]), bias)
        if latent:
            self.fc1_latent_proj = Linear(hidden, expert_dim, bias)
            self.fc2_latent_proj = Linear(expert_dim, hidden, bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        h = self.fc1_latent_proj(x)
        out = torch.zeros_like(h, dtype=torch.float32)  # accumulated in float32, as transformers does
        for expert in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert)
            out.index_add_(0, rows, self.experts[expert](h[rows]) * weights[rows, slot, None])
        return self.fc2_latent_proj(out.to(x.dtype)) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """``norm -> mixer`` on the residual stream; Mamba and attention mixers hold a cache."""

    def __init__(self, config: ModelConfig, kind: str, dims: Mamba2Dims) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(dims, params_dtype=config.dtype)
        elif kind == "full_attention":
            # transformers' NemotronH attention has no biases whatever attention_bias says.
            self.mixer = BambaAttention(dataclasses.replace(config, attention_bias=False), NoRotary())
        elif kind == "mlp":
            bias = bool(config.hf_config.get("mlp_bias", False))
            self.mixer = NemotronHMLP(config.hidden_size, config.intermediate_size, bias)
        else:
            self.mixer = NemotronHMoE(config)

    def forward(
        self, rope: Rope | None, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = pre_norm(self.norm, x, residual)
        if self.kind == "full_attention":
            return self.mixer(rope, x, batch), residual
        if self.kind == "linear_attention":
            return self.mixer(x, batch), residual
        return self.mixer(x), residual


class NemotronHModel(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        cfg = config.hf_config
        if cfg.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"mlp_hidden_act {cfg['mlp_hidden_act']!r} is not supported (NemotronH: relu2)")
        dims = Mamba2Dims.from_config(hf_attrs(config))
        super().__init__(
            ("embeddings", VocabEmbedding(config.vocab_size, config.hidden_size)),
            [NemotronHBlock(config, kind, dims) for kind in block_kinds(config)],
            ("norm_f", NemotronHRMSNorm(config.hidden_size, config.rms_norm_eps)),
        )


class NemotronHForCausalLM(CausalLM):
    """NVIDIA Nemotron-H / Nemotron 3: Mamba2, attention, MLP and MoE blocks; only the first two cache."""

    # q/k/v only: the MLPs' up_proj is not half of a gate_up_proj here.
    packed_modules_mapping = {k: v for k, v in FUSED_QKV_GATE_UP.items() if k.startswith(("q_", "k_", "v_"))}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "backbone", NemotronHModel(config))
