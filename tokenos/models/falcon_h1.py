"""FalconH1ForCausalLM: every decoder layer runs attention AND a Mamba2 mixer in parallel on one normed input.

Layer: ``h = input_layernorm(x)``, ``x + mamba(h) * ssm_out_multiplier + attn(h * attention_in_multiplier) *
attention_out_multiplier``, then ``pre_ff_layernorm -> MLP -> +``. Each layer therefore owns two caches,
two cache layers (``<layer>.self_attn.attn``: an attention page tensor, ``<layer>.mamba``: a
``[conv_pool, ssm_pool]`` pair); all attention entries form one KV-cache group and all Mamba entries
another, exactly as in a model with separate attention and Mamba layers, so the core and the worker see
nothing new.

muP multipliers. Those that sit between modules are applied in the forward (embeddings, lm head,
attention in/out, SSM out). Those inside modules shared with other families are folded into the adjacent
linear weights at load time, which is exact up to rounding: ``key_multiplier`` into k_proj,
``mlp_multipliers`` into gate_proj and down_proj, ``ssm_in_multiplier`` and the per-section
``ssm_multipliers`` (transformers' ``mup_vector`` over ``[z, x, B, C, dt]``) into the mixer's in_proj.
The mixer's output gate is ``y * silu(z)`` without a norm unless ``mamba_rms_norm`` (then a grouped
RMSNorm before or after the gate, ``mamba_norm_before_gate``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer, gated_rms_norm
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.layers.weights import WeightHolder, scale_on_load
from tokenos.models.bamba import BambaAttention, BambaMLP
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack, pre_norm
from tokenos.models.config import ModelConfig
from tokenos.models.granitemoehybrid import ScaledEmbedding, mamba_dims
from tokenos.models.hybrid import partial_rotary


def mup_vector(dims: Mamba2Dims, multipliers: list[float]) -> torch.Tensor:
    """One factor per in_proj output row: ``multipliers[i]`` over section i of ``[z, x, B, C, dt]``."""
    bc = dims.n_groups * dims.state_size
    sizes = [dims.intermediate_size, dims.intermediate_size, bc, bc, dims.num_heads]
    # float32 whatever the model dtype: the factors multiply the checkpoint tensor before it is cast.
    return torch.cat(
        [torch.full((n,), float(m), dtype=torch.float32) for n, m in zip(sizes, multipliers, strict=True)]
    )


class FalconH1Mixer(Mamba2Mixer):
    def __init__(self, config: ModelConfig, dims: Mamba2Dims) -> None:
        super().__init__(dims, params_dtype=config.dtype)
        cfg = config.hf_config
        # The out projection's bias follows projectors_bias, in_proj's mamba_proj_bias (dims.use_bias).
        out_bias = dims.hidden_size if cfg.get("projectors_bias", False) else None
        self.out_proj = WeightHolder((dims.hidden_size, dims.intermediate_size), out_bias, config.dtype)
        self.norm_before_gate = bool(cfg.get("mamba_norm_before_gate", True))
        if not cfg.get("mamba_rms_norm", False):
            self.norm = None
        rows = mup_vector(dims, cfg.get("ssm_multipliers") or [1.0] * 5)
        scale_on_load(self.in_proj.weight, rows[:, None] * float(cfg.get("ssm_in_multiplier", 1.0)))
        if self.in_proj.bias is not None:
            scale_on_load(self.in_proj.bias, rows)

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return y.float() * F.silu(gate.float())
        d = self.dims
        group = d.intermediate_size // d.n_groups
        return gated_rms_norm(y, gate, self.norm.weight, group, d.eps, self.norm_before_gate)


class FalconH1Attention(BambaAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(config, rotary)
        key_multiplier = float(config.hf_config.get("key_multiplier", 1.0))
        for param in self.qkv_proj.parameters():
            scale_on_load(param, key_multiplier, "k")


class FalconH1MLP(BambaMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        gate_multiplier, down_multiplier = config.hf_config.get("mlp_multipliers") or (1.0, 1.0)
        for param in self.gate_up_proj.parameters():
            scale_on_load(param, float(gate_multiplier), 0)
        for param in self.down_proj.parameters():
            scale_on_load(param, float(down_multiplier))


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dims: Mamba2Dims) -> None:
        super().__init__()
        cfg = config.hf_config
        self.attention_in_multiplier = float(cfg.get("attention_in_multiplier", 1.0))
        self.attention_out_multiplier = float(cfg.get("attention_out_multiplier", 1.0))
        self.ssm_out_multiplier = float(cfg.get("ssm_out_multiplier", 1.0))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = FalconH1Attention(config, rotary)
        self.mamba = FalconH1Mixer(config, dims)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FalconH1MLP(config)

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = pre_norm(self.input_layernorm, x, residual)
        ssm = self.mamba(h, batch) * self.ssm_out_multiplier
        attn = self.self_attn(rope, h * self.attention_in_multiplier, batch)
        x, residual = self.pre_ff_layernorm(ssm + attn * self.attention_out_multiplier, residual)
        return self.feed_forward(x), residual


class FalconH1Model(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        cfg = config.hf_config
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Falcon-H1: only silu)")
        dims = mamba_dims(config)
        multiplier = float(cfg.get("embedding_multiplier", 1.0))
        rotary = partial_rotary(config)
        super().__init__(
            ("embed_tokens", ScaledEmbedding(config.vocab_size, config.hidden_size, multiplier)),
            [FalconH1DecoderLayer(config, rotary, dims) for _ in range(config.num_hidden_layers)],
            ("final_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


class FalconH1ForCausalLM(CausalLM):
    """TII Falcon-H1: parallel attention + Mamba2 in every layer (two cache entries per layer)."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", FalconH1Model(config))
        self.lm_head_multiplier = float(config.hf_config.get("lm_head_multiplier", 1.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier
