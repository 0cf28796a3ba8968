"""Fine-grained prefix hits for hybrid models: resume between attention page boundaries.

Idea. A hybrid model can resume at token h only if every recurrent group has a checkpoint of the
state after exactly h tokens. vLLM ties checkpoints to the attention page (hundreds of tokens), so
a shared 500-token system prompt never hits. Here a hit may end at any checkpoint length h:
- a multiple of the recurrent checkpoint interval C (`MambaSpec.block_size`, set independently of
  the attention page size B by `CacheConfig.mamba_checkpoint_interval`; "all" mode checkpoints
  every C tokens of a prompt), keyed by the request's chained hash at h;
- the exact end of a finished request ("end" checkpoints, `CacheConfig.mamba_checkpoint_at_end`),
  keyed by `exact_prefix_hash` (the grid hash before h chained with the tail tokens), so the next
  turn of a chat, whose prompt extends the previous turn's prompt and answer, resumes there.

Attention at a hit h: pages [0, h // B) are shared by refcount. If h % B != 0 the page of column
h // B is COPY-ON-WRITE: the request gets a fresh private page and the worker copies the source
page into it before the step (`SchedulerOutput.prefix_page_copies`); the request overwrites slots
[h % B, B) before reading them. A recurrent checkpoint between two interval boundaries (an exact
end) is copied the same way, since the request's running page is that column and is written in
place. The copy-on-write bookkeeping (private page, queued copy, reference on the source until
the copy ran) is `tokenos.core.kv_cache.cow`, shared with n > 1 forks.

Where partial attention pages come from:
1. The sub-page index, filled after each step: for every hash-grid boundary inside a page the
   request has written, key -> (block, generation). An entry is valid while the block has not
   been handed out again (`KVCacheBlock.generation` unchanged): it covers running requests' pages,
   cached full pages and freed pages not yet reused, with no extra reference held.
2. End-of-request partial pages, published in the block pool under the exact key (so, once freed,
   they sit in the LRU free queue like any cached page and are evicted lazily).

Memory. Checkpoint pages are ordinary pool pages: "all" mode holds ceil(tokens / C) pages per
recurrent group while a request runs (counted in `MambaSpec.max_memory_usage_bytes`), and every
one of them becomes an evictable cached page when it ends; an end checkpoint adds no page (it
publishes the running page). A hit holds one extra page per copy-on-write source until its
first step has run. The sub-page index and the tail index hold small tuples, pruned when stale and swept
when they exceed a few entries per pool block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenos.core.hashing import exact_prefix_hash
from tokenos.core.kv_cache.block_pool import BlockPool, KVCacheBlock, group_key
from tokenos.core.kv_cache.cow import CacheHit
from tokenos.core.kv_cache.single_type_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)

if TYPE_CHECKING:
    from tokenos.core.hashing import BlockHash, HashFn
    from tokenos.core.request import Request


class FinePrefixCache:
    def __init__(
        self,
        managers: tuple[SingleTypeKVCacheManager, ...],
        block_pool: BlockPool,
        hash_block_size: int,
        hash_fn: HashFn,
        checkpoint_at_end: bool,
    ) -> None:
        others = [m for m in managers if not isinstance(m, FullAttentionManager | MambaManager)]
        if others:
            raise ValueError(
                "fine-grained hybrid prefix caching (mamba_checkpoint_interval / mamba_checkpoint_at_end) "
                f"supports full attention and recurrent groups only, not {type(others[0]).__name__}."
            )
        self.attn = tuple(m for m in managers if isinstance(m, FullAttentionManager))
        self.rec = tuple(m for m in managers if isinstance(m, MambaManager))
        self.num_groups = len(managers)
        self.pool = block_pool
        self.hbs = hash_block_size
        self.hash_fn = hash_fn
        self.at_end = checkpoint_at_end
        self.sub: dict[bytes, tuple[KVCacheBlock, int]] = {}
        # Exact checkpoints by the grid hash before them (None: before the first hash block):
        # parent -> {exact key -> tail length}.
        self.tails: dict[BlockHash | None, dict[BlockHash, int]] = {}
        # Where the last hit came from: "end_checkpoint" (a finished request's exact end) or
        # "checkpoint" (a grid point: a page boundary or an interval checkpoint).
        self.last_source = "checkpoint"
        self.indexed: dict[str, int] = {}  # request id -> tokens already in the sub-page index
        per_page = max((m.block_size // hash_block_size for m in self.attn), default=1)
        self.max_sub = 4 * block_pool.num_blocks * per_page

    # ------------------------------------------------------------------ lookup

    def find(self, request: Request, max_length: int) -> CacheHit:
        """The longest checkpoint length <= max_length every group can resume from."""
        hashes = request.block_hashes
        full = {
            m.group_id: FullAttentionManager.find_longest_cache_hit(
                hashes, max_length, [m.group_id], self.pool, m.spec, m.hash_stride
            )[0][0]
            for m in self.attn
        }
        hbs = self.hbs
        for i in range(min(max_length // hbs, len(hashes)), -1, -1):
            tails = self.tails.get(hashes[i - 1] if i else None)
            if tails:
                for key, t in sorted(tails.items(), key=lambda kv: -kv[1]):
                    h = i * hbs + t
                    if h <= max_length and exact_prefix_hash(self.hash_fn, request, h, hbs) == key:
                        hit = self._resume_at(h, key, full)
                        if hit is not None:
                            self.last_source = "end_checkpoint"
                            return hit
            # Any grid point: interval checkpoints, and end checkpoints that fell on the grid.
            if i:
                hit = self._resume_at(i * hbs, hashes[i - 1], full)
                if hit is not None:
                    self.last_source = "checkpoint"
                    return hit
        return CacheHit.miss(self.num_groups)

    def _resume_at(self, h: int, key: BlockHash, full: dict[int, list[KVCacheBlock]]) -> CacheHit | None:
        blocks: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        cow: dict[int, int] = {}
        for m in self.rec:
            b = self.pool.get_cached_block(key, m.group_id)
            if b is None:
                return None
            j = (h - 1) // m.block_size
            blocks[m.group_id] = [self.pool.null_block] * j + [b]
            if h % m.block_size:
                cow[m.group_id] = j  # mid-column state: the running page, so copy it
        for m in self.attn:
            q, r = divmod(h, m.block_size)
            pages = full[m.group_id]
            if q > len(pages):
                return None
            lst = pages[:q]
            if r:
                src = self._partial_page(key, m.group_id)
                if src is None:
                    return None
                cow[m.group_id] = q
                lst = [*lst, src]
            blocks[m.group_id] = lst
        return CacheHit(tuple(blocks), h, cow)

    def _partial_page(self, key: BlockHash, group_id: int) -> KVCacheBlock | None:
        b = self.pool.get_cached_block(key, group_id)  # an end-of-request partial page
        if b is not None:
            return b
        k = group_key(key, group_id)
        entry = self.sub.get(k)
        if entry is None:
            return None
        b, generation = entry
        if b.generation != generation:
            del self.sub[k]  # handed out again since: its slots no longer hold this prefix
            return None
        return b

    # ------------------------------------------------------------------ after a step / at the end

    def after_step(self, request: Request) -> None:
        """Index the sub-page boundaries the request's last step wrote (valid from now on)."""
        rid = request.request_id
        hbs, hashes = self.hbs, request.block_hashes
        start = self.indexed.get(rid, 0) // hbs + 1
        end = min(request.num_computed_tokens // hbs, len(hashes))
        for i in range(start, end + 1):
            for m in self.attn:
                q, r = divmod(i * hbs, m.block_size)
                blocks = m.req_to_blocks.get(rid)
                if r and blocks and q < len(blocks) and not blocks[q].is_null:
                    b = blocks[q]
                    self.sub[group_key(hashes[i - 1], m.group_id)] = (b, b.generation)
        self.indexed[rid] = max(end * hbs, self.indexed.get(rid, 0))
        if len(self.sub) > self.max_sub:
            self.sub = {k: e for k, e in self.sub.items() if e[0].generation == e[1]}

    def publish_end(self, request: Request) -> None:
        """Publish the state after exactly `num_computed_tokens` tokens of a finished request."""
        if not self.at_end:
            return
        rid, length = request.request_id, request.num_computed_tokens
        if length == 0 or any(m.mode == "none" for m in self.rec):
            return
        key = exact_prefix_hash(self.hash_fn, request, length, self.hbs)
        pages = [(m, (length - 1) // m.block_size) for m in self.rec]
        pages += [(m, length // m.block_size) for m in self.attn if length % m.block_size]
        for m, col in pages:
            blocks = m.req_to_blocks.get(rid)
            if not blocks or col >= len(blocks) or blocks[col].is_null:
                return
            b = blocks[col]
            if b.block_hash is None:
                self.pool.cache_block(b, key, m.group_id)
        if length % self.hbs:
            i = length // self.hbs
            parent = request.block_hashes[i - 1] if i else None
            self.tails.setdefault(parent, {})[key] = length % self.hbs
            if len(self.tails) > self.pool.num_blocks:
                self._sweep_tails()

    def _sweep_tails(self) -> None:
        probe = self.rec[0].group_id
        kept: dict[BlockHash | None, dict[BlockHash, int]] = {}
        for parent, entries in self.tails.items():
            live = {k: t for k, t in entries.items() if self.pool.get_cached_block(k, probe) is not None}
            if live:
                kept[parent] = live
        self.tails = kept

    def free(self, request_id: str) -> None:
        self.indexed.pop(request_id, None)
