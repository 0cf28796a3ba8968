"""Per-spec block managers: which blocks one KV-cache group needs for one request.

Every manager keeps, per request, a block list indexed by LOGICAL BLOCK COLUMN: entry j covers
tokens [j * block_size, (j + 1) * block_size). Columns a group no longer needs (or never needed)
hold the null block, so block-table indices mean the same thing in every group.

- Full attention: every column is a real block; a hit is the longest run of cached blocks
  from the start.
- Sliding window: only columns intersecting the window of the next token are kept; older ones
  are freed and replaced by the null block as decoding proceeds. A hit needs only the last
  `cdiv(window - 1, block_size)` blocks before the boundary to be cached.
- Recurrent state (MambaSpec): a page is a checkpoint of the state after an exact prefix. Column
  j holds the state after `(j + 1) * block_size` tokens once the request has passed that
  boundary; a hit is the latest cached checkpoint, earlier columns are null. Modes: "align"
  keeps the running column plus the previous one; "all" allocates every column a step crosses
  (the worker writes a checkpoint into each) and then, once they are published, frees all but
  the previous and running ones into the evictable cache; "none" keeps a single page at column 0
  and never caches. See `tokenos.core.sched.output` for the worker's rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenos.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenos.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

if TYPE_CHECKING:
    from tokenos.core.hashing import BlockHash
    from tokenos.core.request import Request

_EMPTY: list[KVCacheBlock] = []


class SingleTypeKVCacheManager:
    """Blocks of one group. Subclasses change how hits are found and which columns are kept."""

    # True for managers whose caching must wait until the step that writes the block has run.
    publishes_after_step = False
    # True for managers that drop columns as the request advances (remove_skipped_blocks).
    skips_blocks = False

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.null_block = block_pool.null_block
        # Hash blocks per group block: column j is named by hash (j + 1) * stride - 1.
        self.hash_stride = spec.block_size // hash_block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Columns [0, n) of the request have been offered to the hash index.
        self.num_cached_block: dict[str, int] = {}
        # Columns [0, n) are known to be null already (removal low-water mark).
        self.num_skipped_block: dict[str, int] = {}

    # ------------------------------------------------------------------ sizing

    def num_required_columns(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        have = len(self.req_to_blocks.get(request_id, _EMPTY)) + len(new_computed_blocks)
        n = self.num_required_columns(num_tokens) - have
        if new_computed_blocks:
            # A hit that sits in the free queue is taken out of it: it costs a free block too.
            n += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(n, 0)

    # ------------------------------------------------------------------ allocation

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        assert request_id not in self.req_to_blocks, "cache hits are only taken by new requests"
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        n = self.num_required_columns(num_tokens) - len(blocks)
        if n <= 0:
            return _EMPTY
        new = self.block_pool.get_new_blocks(n)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the columns that are full once `num_tokens` tokens are computed."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[rid]
        hashes = request.block_hashes
        stride, gid, pool = self.hash_stride, self.group_id, self.block_pool
        for j in range(num_cached, num_full):
            b = blocks[j]
            if b.block_hash is None and not b.is_null:
                pool.cache_block(b, hashes[(j + 1) * stride - 1], gid)
        self.num_cached_block[rid] = num_full

    def uncache_blocks_from(self, request: Request, num_tokens: int) -> None:
        """Unpublish columns past the first `num_tokens` tokens (their step will not run)."""
        rid = request.request_id
        start = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        blocks = self.req_to_blocks.get(rid, _EMPTY)
        for j in range(start, min(num_cached, len(blocks))):
            self.block_pool.uncache_block(blocks[j])
        if num_cached > start:
            self.num_cached_block[rid] = start

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int] | None:
        """Free columns the request will never read again; returns their indices (or None)."""
        return None

    def _free_columns_before(self, request_id: str, end: int) -> list[int] | None:
        start = self.num_skipped_block.get(request_id, 0)
        if end <= start:
            return None
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return None
        end = min(end, len(blocks))
        removed: list[int] = []
        freed: list[KVCacheBlock] = []
        null = self.null_block
        for j in range(end - 1, start - 1, -1):  # tail first: children are evicted before parents
            b = blocks[j]
            if b is not null:
                removed.append(j)
                freed.append(b)
                blocks[j] = null
        self.num_skipped_block[request_id] = end
        if not removed:
            return None
        self.block_pool.free_blocks(freed)
        return removed

    def token_horizon(self, request_id: str, caching: bool) -> int:
        """Largest token count the request can reach with no new block and nothing to publish
        in this group (the manager's fast path for decode steps)."""
        bs = self.block_size
        cap = len(self.req_to_blocks.get(request_id, _EMPTY)) * bs
        if caching and not self.publishes_after_step:
            cap = min(cap, (self.num_cached_block.get(request_id, 0) + 1) * bs - 1)
        return cap

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)
        self.num_skipped_block.pop(request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, _EMPTY)]

    # ------------------------------------------------------------------ prefix hits

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: KVCacheSpec,
        hash_stride: int,
    ) -> tuple[list[list[KVCacheBlock]], int]:
        """(blocks per group, hit length in tokens) for the longest hit of at most `max_length`."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, hash_stride):
        computed: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        for j in range(max_length // spec.block_size):
            h = block_hashes[(j + 1) * hash_stride - 1]
            found = [block_pool.get_cached_block(h, gid) for gid in group_ids]
            if None in found:
                break  # chained hashes: a miss here means every later block misses too
            for lst, b in zip(computed, found, strict=True):
                lst.append(b)
        return computed, len(computed[0]) * spec.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    skips_blocks = True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int] | None:
        # The next query (position num_computed_tokens) reads keys from position
        # num_computed_tokens - window + 1 on; whole columns before that are dead.
        first_needed = num_computed_tokens - self.spec.sliding_window + 1
        if first_needed <= 0:
            return None
        return self._free_columns_before(request_id, first_needed // self.block_size)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, hash_stride):
        block_size = spec.block_size
        num_blocks = max_length // block_size
        need = cdiv(spec.sliding_window - 1, block_size)  # contiguous cached columns required
        null = block_pool.null_block
        if need == 0:
            return [[null] * num_blocks for _ in group_ids], num_blocks * block_size
        computed = [[null] * num_blocks for _ in group_ids]
        run = 0
        for j in range(num_blocks - 1, -1, -1):
            h = block_hashes[(j + 1) * hash_stride - 1]
            found = [block_pool.get_cached_block(h, gid) for gid in group_ids]
            if None in found:
                run = 0
                continue
            for lst, b in zip(computed, found, strict=True):
                lst[j] = b
            run += 1
            if run >= need:
                end = j + run
                return [lst[:end] for lst in computed], end * block_size
        # Reached column 0: a run starting at the beginning is a hit however short it is.
        return [lst[:run] for lst in computed], run * block_size


class MambaManager(SingleTypeKVCacheManager):
    publishes_after_step = True

    def __init__(self, spec: MambaSpec, block_pool: BlockPool, group_id: int, hash_block_size: int) -> None:
        super().__init__(spec, block_pool, group_id, hash_block_size)
        self.mode = spec.cache_mode
        self.skips_blocks = self.mode != "none"

    def running_column(self, num_tokens: int) -> int:
        """Column whose page holds the state after `num_tokens` tokens (the running state)."""
        if self.mode == "none":
            return 0
        return (num_tokens - 1) // self.block_size

    def state_copy(self, num_computed_tokens: int, num_tokens: int) -> tuple[int, int] | None:
        """(src, dst) columns the worker copies before a step from `num_computed_tokens` to
        `num_tokens`, so the running page starts from the previous state (None: no copy)."""
        if self.mode == "none" or num_computed_tokens == 0:
            return None
        src = (num_computed_tokens - 1) // self.block_size
        dst = (num_tokens - 1) // self.block_size
        return (src, dst) if src != dst else None

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks):
        blocks = self.req_to_blocks.get(request_id, _EMPTY)
        have = len(blocks) + len(new_computed_blocks)
        if self.mode == "all":
            n = cdiv(num_tokens, self.block_size) - have
        elif self.mode == "align":
            n = 1 if self.running_column(num_tokens) >= have else 0
        else:
            n = 0 if have else 1
        if new_computed_blocks:
            n += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(n, 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        if self.mode == "all":
            return super().allocate_new_blocks(request_id, num_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        col = self.running_column(num_tokens)
        if col < len(blocks):
            return _EMPTY
        # align: columns between the previous state and the new running one stay null.
        new = [self.null_block] * (col - len(blocks))
        new.extend(self.block_pool.get_new_blocks(1))
        blocks.extend(new)
        return new

    def token_horizon(self, request_id: str, caching: bool) -> int:
        if self.mode == "none" and self.req_to_blocks.get(request_id):
            return 1 << 62  # one page for the whole life of the request
        return len(self.req_to_blocks.get(request_id, _EMPTY)) * self.block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish checkpoints; call only after the step reaching `num_tokens` has run."""
        if self.mode == "all":
            super().cache_blocks(request, num_tokens)
        elif self.mode == "align" and num_tokens % self.block_size == 0:
            # In align mode only a step that ENDS on a boundary leaves a checkpoint there; the
            # running column of a step that crossed a boundary holds a mid-block state.
            rid = request.request_id
            j = num_tokens // self.block_size - 1
            blocks = self.req_to_blocks.get(rid, _EMPTY)
            if j < len(blocks):
                b = blocks[j]
                if b.block_hash is None and not b.is_null:
                    self.block_pool.cache_block(
                        b, request.block_hashes[(j + 1) * self.hash_stride - 1], self.group_id
                    )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int] | None:
        if self.mode == "none" or num_computed_tokens == 0:
            return None
        # Keep the previous state's column (the source of this step's copy) and later ones; in
        # "all" mode the older columns are published checkpoints: freeing them leaves them cached.
        return self._free_columns_before(request_id, (num_computed_tokens - 1) // self.block_size)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, hash_stride):
        if spec.cache_mode == "none":
            return [[] for _ in group_ids], 0
        null = block_pool.null_block
        for j in range(max_length // spec.block_size - 1, -1, -1):
            h = block_hashes[(j + 1) * hash_stride - 1]
            found = [block_pool.get_cached_block(h, gid) for gid in group_ids]
            if None not in found:
                # The checkpoint at the boundary summarises everything before it.
                return [[null] * j + [b] for b in found], (j + 1) * spec.block_size
        return [[] for _ in group_ids], 0


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int, hash_block_size: int):
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, block_pool, group_id, hash_block_size)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id, hash_block_size)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, block_pool, group_id, hash_block_size)
    raise ValueError(f"no KV-cache manager for spec type {type(spec).__name__}.")
