"""GraniteMoeHybridForCausalLM (IBM Granite 4.0-H): Bamba's Mamba2 + attention stack with Granite's muP
multipliers and a mixture-of-experts feed-forward beside a shared MLP.

Per layer (``layer_types``): a Mamba2 mixer (``mamba``) or attention (``self_attn``, scaled by
``attention_multiplier`` instead of ``head_dim ** -0.5``, rotary only if ``position_embedding_type`` is
"rope"), then ``shared_mlp(x)`` plus, when ``num_local_experts > 0``, a top-k MoE (softmax over the
top-k router logits). Each sub-block's output is scaled by ``residual_multiplier`` before it joins the
residual stream; the embeddings are scaled by ``embedding_multiplier`` and the logits divided by
``logits_scaling``. The experts are stored as one ``[E, 2I, H]`` / ``[E, H, I]`` tensor per layer, as in the
checkpoint, and computed plainly, one expert at a time over the tokens routed to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.rotary import NoRotary, RotaryEmbedding
from tokenos.layers.weights import WeightHolder
from tokenos.models.bamba import BambaAttention, layer_types
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.hybrid import HybridDecoderLayer, hf_attrs, partial_rotary


class ScaledEmbedding(VocabEmbedding):
    """Embeddings times a constant (muP's ``embedding_multiplier``); the weight stays tie-able."""

    def __init__(self, vocab_size: int, hidden_size: int, multiplier: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.multiplier


def uses_rope(config: ModelConfig) -> bool:
    """Rotary only for "rope"; Granite 4.0-H checkpoints say "nope" (transformers: anything but "rope")."""
    kind = config.hf_config.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type {kind!r} is not supported (use 'rope', 'nope' or null)")
    return kind == "rope"


class GraniteMoeHybridAttention(BambaAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__(config, rotary if rotary is not None else NoRotary())
        scale = float(config.hf_config.get("attention_multiplier", self.head_dim**-0.5))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale)


class GraniteMoeHybridMLP(nn.Module):
    """The shared MLP: one fused ``input_linear`` [gate | up], as the checkpoint stores it."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden_size, 2 * intermediate_size)
        self.output_linear = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear(x)))


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.layer = Linear(hidden_size, num_experts)


class GraniteMoeHybridMoE(nn.Module):
    """Top-k experts weighted by a softmax over their router logits (= renormalised top-k probabilities)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.hf_config
        hidden, size, experts = config.hidden_size, config.intermediate_size, int(cfg["num_local_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.router = TopKRouter(hidden, experts)
        self.input_linear = WeightHolder((experts, 2 * size, hidden), None, config.dtype)
        self.output_linear = WeightHolder((experts, hidden, size), None, config.dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, chosen = self.router.layer(x).float().topk(self.top_k, dim=-1)
        weights = F.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert)
            h = self.act(F.linear(x[rows], self.input_linear.weight[expert]))
            h = F.linear(h, self.output_linear.weight[expert]) * weights[rows, slot, None]
            out.index_add_(0, rows, h)
        return out


class GraniteMoeHybridDecoderLayer(HybridDecoderLayer):
    # The post-mixer norm and the feed-forward are methods here: they apply residual_multiplier around
    # modules registered under the checkpoint's names (shared_mlp and block_sparse_moe sit side by side).
    recurrent_name, post_norm_name, mlp_name = "mamba", "scaled_post_norm", "feed_forward"

    def __init__(
        self, config: ModelConfig, kind: str, rotary: RotaryEmbedding | None, dims: Mamba2Dims
    ) -> None:
        super().__init__(kind)
        cfg = config.hf_config
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "full_attention":
            self.self_attn = GraniteMoeHybridAttention(config, rotary)
        else:
            self.mamba = Mamba2Mixer(dims, params_dtype=config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.shared_mlp = GraniteMoeHybridMLP(config.hidden_size, int(cfg["shared_intermediate_size"]))
        self.block_sparse_moe = GraniteMoeHybridMoE(config) if cfg.get("num_local_experts", 0) else None

    def scaled_post_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.post_attention_layernorm(x * self.residual_multiplier, residual)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = out + self.block_sparse_moe(x)
        return out * self.residual_multiplier


def mamba_dims(config: ModelConfig) -> Mamba2Dims:
    """Mamba2Dims of a Granite or Falcon-H1 config, resolving ``mamba_d_head="auto"`` as transformers does."""
    attrs = hf_attrs(config)
    if getattr(attrs, "mamba_d_head", None) == "auto":
        inner = getattr(attrs, "mamba_d_ssm", None) or int(attrs.mamba_expand) * config.hidden_size
        attrs.mamba_d_head = inner // int(attrs.mamba_n_heads)
    return Mamba2Dims.from_config(attrs)


class GraniteMoeHybridModel(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        cfg = config.hf_config
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {cfg['hidden_act']!r} is not supported (GraniteMoeHybrid: only silu)"
            )
        dims = mamba_dims(config)
        multiplier = float(cfg.get("embedding_multiplier", 1.0))
        embed = ScaledEmbedding(config.vocab_size, config.hidden_size, multiplier)
        rotary = partial_rotary(config) if uses_rope(config) else None
        super().__init__(
            ("embed_tokens", embed),
            [GraniteMoeHybridDecoderLayer(config, kind, rotary, dims) for kind in layer_types(config)],
            ("norm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


class GraniteMoeHybridForCausalLM(CausalLM):
    """IBM Granite 4.0-H (and its dense variant, ``num_local_experts=0``): Mamba2 + attention hybrid."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", GraniteMoeHybridModel(config))
        self.logits_scaling = float(config.hf_config.get("logits_scaling", 1.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
