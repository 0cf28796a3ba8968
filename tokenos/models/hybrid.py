"""Pieces every hybrid (attention + recurrent) model shares: per-layer metadata, cache specs, rotary.

Idea: a hybrid model is a stack of layers that each own ONE cache of the paged pool, either an
attention page tensor ``[num_blocks, 2, block_size, kv_heads, head]`` or a list of recurrent state pools
``[num_blocks, *shape]``. The worker builds one metadata object per KV-cache group (the attention groups
get an ``AttentionMetadata``, the recurrent groups a ``RecurrentBatch`` whose ``state_indices`` are the
requests' running pages) and hands the model a ``HybridMetadata`` mapping every layer name to its group's
metadata. Layer ``i`` of ``get_kv_cache_spec`` order reads ``kv_caches[i]`` and ``by_layer[name_i]``; the
model never sees groups, block tables or copies.

Block sizes. ``get_kv_cache_spec(block_size)`` declares every layer with the same ``block_size``. The core's
``get_kv_cache_config`` then raises the attention block size (to a multiple of 16) until one attention page
holds the largest recurrent state, and REPLACES every MambaSpec's block size with that raised attention
block size (padding the recurrent page to the attention page's bytes). So after unification the recurrent
checkpoint interval always equals the final attention block size and both kinds of groups have block
boundaries at the same token positions. The worker must therefore read block sizes from the resulting
``KVCacheConfig`` (``kernel_block_sizes``), never from what it passed here. A model with no attention
layer (pure Mamba2) keeps the requested block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tokenos.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec
from tokenos.layers.attention import AttentionMetadata
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.layers.short_conv import RecurrentBatch
from tokenos.models.base import CausalLM, pre_norm
from tokenos.models.config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass
class HybridMetadata:
    """Per-step metadata of a hybrid forward: layer name (``get_kv_cache_spec``) -> its group's metadata.

    Layers of one KV-cache group share one object (their block ids are equal), so per-step index work is
    done once per group, not per layer.
    """

    by_layer: dict[str, AttentionMetadata | RecurrentBatch] = field(default_factory=dict)

    @classmethod
    def from_groups(
        cls, group_layer_names: list[list[str]], group_metadata: list[AttentionMetadata | RecurrentBatch]
    ) -> HybridMetadata:
        """Every layer of group ``g`` (``group_layer_names[g]``) gets ``group_metadata[g]``."""
        by_layer = {}
        for names, meta in zip(group_layer_names, group_metadata, strict=True):
            for name in names:
                by_layer[name] = meta
        return cls(by_layer)


class CheckpointingBatch(RecurrentBatch):
    """A RecurrentBatch for "all" cache mode: besides the running page, the state after every block
    boundary ``b`` with ``n < b <= n + k`` is written to ``checkpoint_pages`` (one page per boundary, in
    ``checkpoint_positions(checkpoint_every)`` order: by request, then by position)."""

    def __init__(
        self, *args: Any, checkpoint_every: int, checkpoint_pages: torch.Tensor, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.num_computed_tokens is None:
            raise ValueError("a CheckpointingBatch needs num_computed_tokens")
        expected = len(self.checkpoint_positions(checkpoint_every))
        if len(checkpoint_pages) != expected:
            raise ValueError(f"{len(checkpoint_pages)} checkpoint pages for {expected} block boundaries")
        self.checkpoint_every = checkpoint_every
        self.checkpoint_pages = checkpoint_pages.to(device=self.device, dtype=torch.long)


def run_recurrent(mixer: nn.Module, x: torch.Tensor, batch: RecurrentBatch, states: list) -> torch.Tensor:
    """``mixer(x, batch, conv_pool, state_pool)``; with a CheckpointingBatch also write the block-boundary
    states into their pages (conv and recurrent state alike), in place in the pools."""
    if not isinstance(batch, CheckpointingBatch):
        return mixer(x, batch, *states)
    out, ckpt = mixer.forward_with_checkpoints(x, batch, *states, checkpoint_every=batch.checkpoint_every)
    if len(ckpt.req_indices):
        conv, recurrent = states
        conv.index_copy_(0, batch.checkpoint_pages, ckpt.conv_states.to(conv.dtype))
        recurrent.index_copy_(0, batch.checkpoint_pages, ckpt.recurrent_states.to(recurrent.dtype))
    return out


def hf_attrs(config: ModelConfig) -> SimpleNamespace:
    """The raw HF config as attributes (what the recurrent layers' ``Dims.from_config`` read)."""
    return SimpleNamespace(**{k: _decode_floats(v) for k, v in config.hf_config.items()})


def _decode_floats(value: Any) -> Any:
    """transformers writes non-finite floats as ``{"__float__": "Infinity"}`` (``time_step_limit``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def state_dtypes(model_dtype: str) -> tuple[str, str]:
    """(conv state, recurrent state) dtypes: the conv state in the model dtype, the recurrent state float32
    (it accumulates over the whole sequence; that is what the layers are tested for)."""
    return model_dtype, "float32"


def attention_spec(block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, num_kv_heads, head_dim, dtype)


def recurrent_spec(layer: nn.Module, block_size: int, cache_mode: str, dtype: str) -> MambaSpec:
    """The MambaSpec of a recurrent layer (anything with ``dims`` and a ``state_shapes(dims, conv, ssm)``)."""
    shapes, dtypes = layer.state_shapes(layer.dims, *state_dtypes(dtype))
    return MambaSpec(shapes, dtypes, block_size=block_size, cache_mode=cache_mode)


def partial_rotary_dim(config: ModelConfig) -> int:
    """Rotated dims per head: ``head_dim * partial_rotary_factor`` (rope_parameters or top level)."""
    cfg: dict[str, Any] = config.hf_config
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    dim = int(config.head_dim * factor)
    if dim % 2 or dim < 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives an odd rotary dim {dim} for head_dim {config.head_dim}"
        )
    return dim


class PartialRotary(nn.Module):
    """RoPE (rotate-half layout) on the first ``rotary_dim`` dims of each head; the rest pass through."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary_dim = partial_rotary_dim(config)
        self.rotary = RotaryEmbedding(
            self.rotary_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary.cos_sin(positions, dtype)

    def forward(self, rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.rotary_dim
        if d == q.shape[-1]:
            return self.rotary(rope, q, k)
        q_rot, k_rot = self.rotary(rope, q[..., :d], k[..., :d])
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)


def check_layer_caches(names: list[str], meta: HybridMetadata, kv_caches: list) -> None:
    """User-facing check that the worker passed one cache and one metadata per layer."""
    if len(kv_caches) != len(names):
        raise ValueError(
            f"expected {len(names)} layer caches (get_kv_cache_spec order), got {len(kv_caches)}"
        )
    missing = [n for n in names if n not in meta.by_layer]
    if missing:
        raise ValueError(f"HybridMetadata has no metadata for layers {missing[:4]}")


def kv_cache_spec_of(
    layers: list[tuple[str, nn.Module]], block_size: int, cache_mode: str, dtype: str
) -> dict[str, KVCacheSpec]:
    """Specs in layer order: attention modules (``num_kv_heads``, ``head_dim``) get a FullAttentionSpec,
    recurrent modules (``state_shapes``) a MambaSpec with the same block size (see the module docstring)."""
    specs: dict[str, KVCacheSpec] = {}
    for name, layer in layers:
        if hasattr(layer, "state_shapes"):
            specs[name] = recurrent_spec(layer, block_size, cache_mode, dtype)
        else:
            specs[name] = attention_spec(block_size, layer.num_kv_heads, layer.head_dim, dtype)
    return specs


class HybridDecoderLayer(nn.Module):
    """``input_layernorm -> mixer -> + -> post-mixer norm -> MLP -> +``, the mixer being full attention
    (``self_attn``) or a recurrent layer. Subclasses register their modules under the checkpoint's names
    and give the recurrent mixer's, the post-mixer norm's and the MLP's names."""

    recurrent_name: str
    post_norm_name: str
    mlp_name: str

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    @property
    def mixer_name(self) -> str:
        return "self_attn" if self.kind == "full_attention" else self.recurrent_name

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(
        self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, cache, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = pre_norm(self.input_layernorm, x, residual)
        if self.kind == "full_attention":
            x = self.self_attn(rope, x, cache, meta)
        else:
            x = run_recurrent(self.mixer, x, meta, cache)
        x, residual = getattr(self, self.post_norm_name)(x, residual)
        return getattr(self, self.mlp_name)(x), residual


class HybridCausalLM(CausalLM):
    """A CausalLM whose forward takes a ``HybridMetadata``: layer ``i`` (named ``<stack>.layers.i.<mixer>``)
    reads ``kv_caches[i]`` and ``by_layer[name_i]``. Its layers expose ``mixer_name`` and ``mixer``."""

    is_hybrid = True

    def layer_names(self) -> list[str]:
        prefix = f"{self._stack_name}.layers"
        return [f"{prefix}.{i}.{layer.mixer_name}" for i, layer in enumerate(self.stack.layers)]

    def layer_metadata(self, attn_metadata: HybridMetadata, kv_caches: list) -> list:
        names = self.layer_names()
        check_layer_caches(names, attn_metadata, kv_caches)
        return [attn_metadata.by_layer[name] for name in names]

    def get_kv_cache_spec(self, block_size: int, mamba_cache_mode: str = "align") -> dict[str, KVCacheSpec]:
        """FullAttentionSpec per attention layer, MambaSpec per recurrent layer, in layer order."""
        names = self.layer_names()
        layers = [(name, layer.mixer) for name, layer in zip(names, self.stack.layers, strict=True)]
        return kv_cache_spec_of(layers, block_size, mamba_cache_mode, self.config.dtype_name)
