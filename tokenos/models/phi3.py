"""Phi-3: the Llama decoder with q/k/v and gate/up stored fused in the checkpoint, and partial rotary.

The checkpoint's ``qkv_proj`` and ``gate_up_proj`` are split into our fused layers' shards at load (so
the loader still checks every shard arrives); ``partial_rotary_factor`` rotates only the first
``head_dim * factor`` dims of each head. Rope is default or longrope (the "128k" checkpoints; their configs
may call it ``su`` or ``yarn``, `tokenos.models.config` reads both as longrope); transformers' Phi3Config
refuses any other type, and so does this model. How longrope's short / long factors are chosen per
position is in `tokenos.layers.rotary`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.linear import MergedLinear
from tokenos.layers.quantization import QuantizedTensor
from tokenos.models.base import CausalLM
from tokenos.models.config import ModelConfig
from tokenos.models.llama import DecoderModel

_PHI3_ROPE_TYPES = ("default", "longrope")


def _rope_settings(config: ModelConfig) -> tuple[str, float]:
    """(rope type as resolved by the config layer, partial rotary factor from the checkpoint's
    rope_parameters / rope_scaling or its top level)."""
    cfg = config.hf_config
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return rope_type, float(factor)


def _split_rows(
    loaded: torch.Tensor | QuantizedTensor, sizes: list[int]
) -> list[torch.Tensor | QuantizedTensor]:
    """The fused tensor's row blocks; a quantized one (a GGUF's attn_qkv / ffn_up) stays quantized."""
    if not isinstance(loaded, QuantizedTensor):
        return list(loaded.split(sizes, 0))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [loaded.map_rows(lambda t, a=a, n=n: t[a : a + n]) for a, n in zip(offsets, sizes, strict=True)]


def split_whole_on_load(module: MergedLinear) -> None:
    """Make `module` take a checkpoint tensor of the whole fused projection, split into its shards."""
    shard_ids = module.shard_ids()

    def loader(param: nn.Parameter, loaded: torch.Tensor, *shard: str | int) -> None:
        if shard:
            module.weight_loader(param, loaded, *shard)
            return
        for shard_id, part in zip(shard_ids, _split_rows(loaded, module.output_sizes), strict=True):
            module.weight_loader(param, part, shard_id)

    for p in module.parameters():
        p.weight_loader = loader
        p.shard_ids = (None,)  # the checkpoint provides the whole tensor at once


class Phi3ForCausalLM(CausalLM):
    packed_modules_mapping: dict = {}

    def __init__(self, config: ModelConfig) -> None:
        rope_type, factor = _rope_settings(config)
        if rope_type not in _PHI3_ROPE_TYPES:
            raise ValueError(f"Phi3: rope_type {rope_type!r} is not one of {', '.join(_PHI3_ROPE_TYPES)}")
        rotary_dim = int(config.head_dim * factor)
        super().__init__(config, "model", DecoderModel(config, rotary_dim=rotary_dim))
        for layer in self.stack.layers:
            split_whole_on_load(layer.self_attn.qkv_proj)
            split_whole_on_load(layer.mlp.gate_up_proj)
