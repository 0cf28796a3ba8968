"""Allocate the KV-cache pool and give each layer its view of it.

Each `KVCacheTensor` is one flat byte buffer of `num_blocks * page_size` bytes; every layer
that shares it sees the same pages with the block dimension outermost, so block `b` of any
layer in that buffer is the byte range `[b * page_size, (b + 1) * page_size)`. Because the
memory manager hands each block id to at most one group at a time, a write through one
layer's view can never land in a page another request owns.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable

import torch

from tokenos.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
)
from tokenos.platform import torch_dtype


def _page_view(buf: torch.Tensor, num_blocks: int, page_size: int, nbytes: int, offset: int = 0):
    """Bytes [offset, offset + nbytes) of every page, as a [num_blocks, nbytes] uint8 view."""
    return buf.view(num_blocks, page_size)[:, offset : offset + nbytes]


def attention_view(
    buf: torch.Tensor, num_blocks: int, page_size: int, spec: FullAttentionSpec
) -> torch.Tensor:
    dtype = torch_dtype(spec.dtype)
    shape = (2, spec.block_size, spec.num_kv_heads, spec.head_size)
    nbytes = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * dtype.itemsize
    raw = _page_view(buf, num_blocks, page_size, nbytes)
    return raw.view(dtype).view(num_blocks, *shape)


def mla_view(buf: torch.Tensor, num_blocks: int, page_size: int, spec: MLAAttentionSpec) -> torch.Tensor:
    """An MLA layer's pages: one row of ``head_size`` values per token (latent, then rope key)."""
    dtype = torch_dtype(spec.dtype)
    nbytes = spec.block_size * spec.head_size * dtype.itemsize
    raw = _page_view(buf, num_blocks, page_size, nbytes)
    return raw.view(dtype).view(num_blocks, spec.block_size, 1, spec.head_size)


def mamba_views(buf: torch.Tensor, num_blocks: int, page_size: int, spec: MambaSpec) -> list[torch.Tensor]:
    views = []
    offset = 0
    for shape, dtype_name in zip(spec.shapes, spec.dtypes, strict=True):
        dtype = torch_dtype(dtype_name)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        raw = _page_view(buf, num_blocks, page_size, nbytes, offset)
        views.append(raw.view(dtype).view(num_blocks, *shape))
        offset += nbytes
    return views


def zeroed_buffer(size_bytes: int) -> torch.Tensor:
    """A zeroed byte buffer backed, where the kernel allows it, by transparent huge pages: decode
    attention walks pages scattered over the pool, and 4 KiB pages cost it TLB misses (about 10% of a
    batch-64 decode kernel, measured on a Zen 4 core). On Linux the pool is its own private anonymous
    mapping (fresh zero pages, never a reused and already faulted heap range) advised MADV_HUGEPAGE, which
    THP's usual "madvise" mode honours; elsewhere, plain torch memory."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_ANONYMOUS") or size_bytes == 0:
        return torch.zeros(size_bytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:  # THP unavailable here: 4 KiB pages, still zeroed
        pass
    # Written now, as torch.zeros would: the pages (huge ones) are faulted at start-up, not one by one
    # inside the first steps that reach them (measured: mixed-128 ran 8% slower faulting lazily).
    return torch.frombuffer(mapping, dtype=torch.uint8).zero_()  # the tensor keeps the mapping alive


def allocate_kv_caches(config: KVCacheConfig, layer_order: list[str]) -> list:
    """One cache object per layer, in `layer_order`: a tensor (attention) or a list of tensors (state)."""
    spec_of = {name: g.kv_cache_spec for g in config.kv_cache_groups for name in g.layer_names}
    num_blocks = config.num_blocks
    views: dict[str, object] = {}
    for tensor in config.kv_cache_tensors:
        buf = zeroed_buffer(tensor.size_bytes)
        page_size = tensor.size_bytes // num_blocks
        for name in tensor.shared_by:
            spec = spec_of[name]
            if isinstance(spec, MambaSpec):
                views[name] = mamba_views(buf, num_blocks, page_size, spec)
            elif isinstance(spec, MLAAttentionSpec):
                views[name] = mla_view(buf, num_blocks, page_size, spec)
            else:
                views[name] = attention_view(buf, num_blocks, page_size, spec)
    return [views[name] for name in layer_order]


class PageEpochs:
    """A version number per page of the pool, for caches of what a page holds (cascade attention keeps
    decode groups' shared pages packed between steps, csrc/prefill_attention.c). A page's content
    only changes after the scheduler hands the page to a request (a new block, a copy-on-write
    target, a resumed request's pages), so the runner calls `bump` with every block id it is handed
    and a page whose epoch is unchanged holds what it held. Values come from one counter for the
    whole process, so a later engine's pool (perhaps at the same address) never repeats an epoch."""

    _lock = threading.Lock()
    _next = 0

    def __init__(self, num_blocks: int) -> None:
        self.epochs = self._fresh(num_blocks)

    @classmethod
    def _fresh(cls, n: int) -> torch.Tensor:
        with cls._lock:
            start, cls._next = cls._next, cls._next + n
        return torch.arange(start, start + n, dtype=torch.int64)

    def bump(self, block_ids: Iterable[int]) -> None:
        ids = torch.tensor(sorted(set(block_ids)), dtype=torch.int64)
        if len(ids):
            self.epochs[ids] = self._fresh(len(ids))
