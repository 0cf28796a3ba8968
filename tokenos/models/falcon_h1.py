"""FalconH1ForCausalLM: every decoder layer runs attention AND a Mamba2 mixer in parallel on one normed input.

Layer: ``h = input_layernorm(x)``, ``x + mamba(h) * ssm_out_multiplier + attn(h * attention_in_multiplier) *
attention_out_multiplier``, then ``pre_ff_layernorm -> MLP -> +``. Each layer therefore owns two caches,
registered as two cache entries (``<layer>.self_attn``: an attention page tensor, ``<layer>.mamba``: a
``[conv_pool, ssm_pool]`` pair); all attention entries form one KV-cache group and all Mamba entries
another, exactly as in a model with separate attention and Mamba layers, so the core and the worker see
nothing new. The forward pairs ``kv_caches`` and metadata back up per layer.

muP multipliers. Those that sit between modules are applied in the forward (embeddings, lm head,
attention in/out, SSM out). Those inside modules shared with other families are folded into the adjacent
linear weights at load time, which is exact up to rounding: ``key_multiplier`` into k_proj,
``mlp_multipliers`` into gate_proj and down_proj, ``ssm_in_multiplier`` and the per-section
``ssm_multipliers`` (transformers' ``mup_vector`` over ``[z, x, B, C, dt]``) into the mixer's in_proj.
The mixer's output gate is ``y * silu(z)`` without a norm unless ``mamba_rms_norm`` (then a grouped
RMSNorm before or after the gate, ``mamba_norm_before_gate``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer, gated_rms_norm
from tokenos.layers.short_conv import WeightHolder
from tokenos.model_loader.loader import default_weight_loader
from tokenos.models.bamba import BambaAttention, BambaMLP
from tokenos.models.base import FUSED_QKV_GATE_UP, DecoderStack, pre_norm
from tokenos.models.config import ModelConfig
from tokenos.models.granitemoehybrid import ScaledEmbedding, mamba_dims
from tokenos.models.hybrid import (
    HybridCausalLM,
    PartialRotary,
    Rope,
    kv_cache_spec_of,
    run_recurrent,
)


def fold_multiplier(
    param: nn.Parameter, factor: float | torch.Tensor, shard_id: str | int | None = None
) -> None:
    """Make ``param`` load ``factor * tensor`` (only for shard ``shard_id`` of a fused parameter, if given):
    a multiplier on a linear's output folded into its weight and bias. ``factor`` broadcasts over rows."""
    inner: Callable = getattr(param, "weight_loader", default_weight_loader)

    def loader(target: nn.Parameter, loaded: torch.Tensor, *shard: str | int) -> None:
        if shard_id is None or shard == (shard_id,):
            loaded = loaded.float() * factor
        inner(target, loaded, *shard)

    param.weight_loader = loader


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
        fold_multiplier(self.in_proj.weight, rows[:, None] * float(cfg.get("ssm_in_multiplier", 1.0)))
        if self.in_proj.bias is not None:
            fold_multiplier(self.in_proj.bias, rows)

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return y.float() * F.silu(gate.float())
        d = self.dims
        group = d.intermediate_size // d.n_groups
        return gated_rms_norm(y, gate, self.norm.weight, group, d.eps, self.norm_before_gate)


class FalconH1Attention(BambaAttention):
    def __init__(self, config: ModelConfig, rotary: PartialRotary) -> None:
        super().__init__(config, rotary)
        key_multiplier = float(config.hf_config.get("key_multiplier", 1.0))
        for param in self.qkv_proj.parameters():
            fold_multiplier(param, key_multiplier, "k")


class FalconH1MLP(BambaMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        gate_multiplier, down_multiplier = config.hf_config.get("mlp_multipliers") or (1.0, 1.0)
        for param in self.gate_up_proj.parameters():
            fold_multiplier(param, float(gate_multiplier), 0)
        for param in self.down_proj.parameters():
            fold_multiplier(param, float(down_multiplier))


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: PartialRotary, dims: Mamba2Dims) -> None:
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
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, caches: tuple, metas: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``caches`` = (attention pages, [conv_pool, ssm_pool]); ``metas`` = their groups' metadata."""
        (kv_cache, states), (attn_meta, batch) = caches, metas
        h, residual = pre_norm(self.input_layernorm, x, residual)
        ssm = run_recurrent(self.mamba, h, batch, states) * self.ssm_out_multiplier
        attn = self.self_attn(rope, h * self.attention_in_multiplier, kv_cache, attn_meta)
        x, residual = self.pre_ff_layernorm(ssm + attn * self.attention_out_multiplier, residual)
        return self.feed_forward(x), residual


class FalconH1Model(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        cfg = config.hf_config
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Falcon-H1: only silu)")
        dims = mamba_dims(config)
        multiplier = float(cfg.get("embedding_multiplier", 1.0))
        rotary = PartialRotary(config)
        super().__init__(
            ("embed_tokens", ScaledEmbedding(config.vocab_size, config.hidden_size, multiplier)),
            [FalconH1DecoderLayer(config, rotary, dims) for _ in range(config.num_hidden_layers)],
            ("final_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


def _pairs(items: list) -> list[tuple]:
    return list(zip(items[0::2], items[1::2], strict=True))


class FalconH1ForCausalLM(HybridCausalLM):
    """TII Falcon-H1: parallel attention + Mamba2 in every layer (two cache entries per layer)."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, "model", FalconH1Model(config))
        self.lm_head_multiplier = float(config.hf_config.get("lm_head_multiplier", 1.0))

    def cache_layers(self) -> list[tuple[str, nn.Module]]:
        """(cache entry name, module) in ``kv_caches`` order: each layer's attention, then its Mamba mixer."""
        prefix = f"{self._stack_name}.layers"
        return [
            (f"{prefix}.{i}.{name}", getattr(layer, name))
            for i, layer in enumerate(self.stack.layers)
            for name in ("self_attn", "mamba")
        ]

    def layer_names(self) -> list[str]:
        return [name for name, _ in self.cache_layers()]

    def get_kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> dict:
        return kv_cache_spec_of(self.cache_layers(), block_size, mamba_cache_mode, self.config.dtype_name)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata, kv_caches: list
    ) -> torch.Tensor:
        metas = self.layer_metadata(attn_metadata, kv_caches)
        return self.stack(input_ids, positions, _pairs(metas), _pairs(kv_caches))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier
