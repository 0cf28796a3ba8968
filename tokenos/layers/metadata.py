"""The step contract between the worker and every model: one `ForwardBatch` per step.

A model is built from ordinary modules plus CACHE LAYERS: modules that own one entry of the paged pool
(`Attention`: a K/V page tensor; `RecurrentLayer`: a list of state pools). When the model is built, its
cache layers are numbered in registration order (`bind_cache_layers`); entry ``i``

- is declared by cache layer ``i``'s ``get_kv_cache_spec(cache_config, dtype)`` (the model's
  ``get_kv_cache_spec`` collects them, under the layer's module path, in this order);
- is allocated by the worker as ``kv_caches[i]`` (a tensor for attention, a list of tensors for a state);
- is read every step by cache layer ``i`` through ``batch.entry(i)``: its cache and its KV-cache group's
  metadata, an `AttentionMetadata` (block table, slot mapping, decode groups, prefill chunks) or a
  `RecurrentBatch` (running pages, initial-state flags, "all"-mode checkpoint pages).

So a model's forward takes ``ForwardBatch`` and passes it down; every cache layer finds its own cache and
metadata. Layers of one group share one metadata object, so per-step index work happens once per group.
Adding a model family means writing the model's modules; nothing about groups, block tables or copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenos.config import CacheConfig
    from tokenos.core.kv_cache.spec import KVCacheSpec

# One pool entry: an attention page tensor, or a layer's list of recurrent state pools.
LayerCache = Any


@dataclass
class ForwardBatch:
    """One step's inputs: flat token ids and positions, and per cache entry its cache and metadata."""

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    kv_caches: Sequence[LayerCache]  # entry i, in get_kv_cache_spec order
    metadata: Sequence[Any]  # entry i's group metadata: AttentionMetadata or RecurrentBatch

    @classmethod
    def for_groups(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[LayerCache],
        group_metadata: Sequence[Any],
        entry_groups: Sequence[int],
    ) -> ForwardBatch:
        """Entry ``i`` gets the metadata of its KV-cache group ``entry_groups[i]``."""
        return cls(input_ids, positions, kv_caches, [group_metadata[g] for g in entry_groups])

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def entry(self, index: int) -> tuple[LayerCache, Any]:
        return self.kv_caches[index], self.metadata[index]


class CacheLayer(nn.Module):
    """A module owning one pool entry. Subclasses declare it (``get_kv_cache_spec``) and read it with
    ``self.cache_entry(batch)``; ``cache_index`` is set when the model binds its cache layers."""

    cache_index: int | None = None

    def get_kv_cache_spec(self, cache_config: CacheConfig, dtype: str) -> KVCacheSpec:
        raise NotImplementedError

    def cache_entry(self, batch: ForwardBatch) -> tuple[LayerCache, Any]:
        if self.cache_index is None:
            raise RuntimeError(
                f"{type(self).__name__} has no cache entry: it is not part of a model whose cache layers "
                "were bound (tokenos.layers.metadata.bind_cache_layers)"
            )
        return batch.entry(self.cache_index)


def bind_cache_layers(model: nn.Module) -> list[tuple[str, CacheLayer]]:
    """Number ``model``'s cache layers in registration order (entry i = the i-th); returns (path, layer)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, CacheLayer)]
    for i, (_, layer) in enumerate(layers):
        layer.cache_index = i
    return layers
