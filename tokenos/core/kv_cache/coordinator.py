"""The coordinator: one block pool, one manager per KV-cache group, one answer per request.

A prefix hit must be a token boundary EVERY group can resume from: attention needs all K/V
before it, a sliding window the K/V inside the window, a recurrent group a checkpoint exactly
at it. `find_longest_cache_hit` runs a monotone fixed point: each kind of spec, in turn, either
accepts the candidate length or lowers it to its own longest hit below it; the loop ends when a
full pass changes nothing (a per-group trim is not enough: lowering for a recurrent group can
move the boundary off an attention block boundary, and so on).

Publication timing differs by kind: attention blocks are published when allocated for a step
that fills them (the worker writes every K/V of a step before any attention reads, so a request
admitted in the same step may already share them); recurrent checkpoints only after the step
that writes them has run (`cache_recurrent_blocks`, called from `update_from_output`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenos.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from tokenos.core.kv_cache.cow import CacheHit, CopyOnWrite
from tokenos.core.kv_cache.fine_prefix import FinePrefixCache
from tokenos.core.kv_cache.single_type_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    make_manager,
)
from tokenos.core.kv_cache.spec import KVCacheConfig, MambaSpec

if TYPE_CHECKING:
    from tokenos.core.hashing import BlockHash
    from tokenos.core.request import Request

# Hits are searched kind by kind in this order: cheap prefix scans first, backward searches
# (which only get cheaper as the candidate shrinks) last.
_SEARCH_ORDER = {FullAttentionManager: 0, SlidingWindowManager: 1, MambaManager: 2}


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
        self.config = kv_cache_config
        # Fine-grained hybrid hits (see fine_prefix.py); attached by KVCacheManager when enabled.
        self.fine: FinePrefixCache | None = None
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        hbs = kv_cache_config.hash_block_size
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(g.kv_cache_spec, self.block_pool, gid, hbs)
            for gid, g in enumerate(kv_cache_config.kv_cache_groups)
        )
        self.num_groups = len(self.managers)
        self.cow = CopyOnWrite(self.managers, self.block_pool)
        # Attention-like managers publish at allocation; recurrent ones after the step.
        self.eager_cachers = tuple(m for m in self.managers if not m.publishes_after_step)
        self.recurrent = tuple(m for m in self.managers if isinstance(m, MambaManager))
        self.skippers = tuple(m for m in self.managers if m.skips_blocks)
        self.has_sliding_window = any(isinstance(m, SlidingWindowManager) for m in self.managers)
        # A "none"-mode recurrent group cannot resume from any prefix: caching is pointless.
        self.enable_caching = enable_caching and not any(
            isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.cache_mode == "none"
            for g in kv_cache_config.kv_cache_groups
        )
        # Groups with equal specs search together (a hit must hold in each of them).
        kinds: dict[object, list[int]] = {}
        for gid, g in enumerate(kv_cache_config.kv_cache_groups):
            kinds.setdefault(g.kv_cache_spec, []).append(gid)
        self.hit_kinds = sorted(
            (
                (type(self.managers[ids[0]]), spec, ids, self.managers[ids[0]].hash_stride)
                for spec, ids in kinds.items()
            ),
            key=lambda k: _SEARCH_ORDER[k[0]],
        )

    # ------------------------------------------------------------------ prefix hits

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> CacheHit:
        """The longest boundary all groups share (at most ``max_length`` tokens) and its blocks."""
        hit = max_length
        found: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        while True:
            changed = False
            for cls, spec, ids, stride in self.hit_kinds:
                blocks, length = cls.find_longest_cache_hit(
                    block_hashes, hit, ids, self.block_pool, spec, stride
                )
                if length < hit:
                    hit, changed = length, True
                for gid, lst in zip(ids, blocks, strict=True):
                    found[gid] = lst
            if not changed or hit == 0:
                break
        if hit == 0:
            return CacheHit.miss(self.num_groups)
        # In the final pass every kind returned exactly `hit`, so `found` is consistent.
        return CacheHit(tuple(found), hit)

    def fork_hit(self, parent_id: str, num_tokens: int) -> CacheHit:
        """Hit blocks for a sibling forked from running request `parent_id` at `num_tokens`.

        Attention: the parent's full pages are shared by refcount and its partial page is copied.
        Recurrent: the parent's running page (state after exactly `num_tokens`, updated in place by
        the parent's next step) is copied into the sibling's own running column: the eager state
        copy of a fork. The copies run before the parent's step writes anything.
        """
        blocks: list[list[KVCacheBlock]] = []
        cow: dict[int, int] = {}
        for m in self.managers:
            own = m.req_to_blocks[parent_id]
            if isinstance(m, MambaManager):
                col = m.running_column(num_tokens)
                lst = [self.block_pool.null_block] * col + [own[col]]
                cow[m.group_id] = col
            else:
                q, r = divmod(num_tokens, m.block_size)
                lst = own[:q]
                if r:
                    lst = [*lst, own[q]]
                    cow[m.group_id] = q
            blocks.append(lst)
        return CacheHit(tuple(blocks), num_tokens, cow)

    # ------------------------------------------------------------------ allocation

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hit: CacheHit | None, lookahead: int = 0
    ) -> int:
        """``lookahead``: slots past ``num_tokens`` for a drafter's K/V, in the attention groups only."""
        if hit is None:
            return sum(
                m.get_num_blocks_to_allocate(request_id, self._extent(m, num_tokens, lookahead), ())
                for m in self.managers
            )
        need = sum(
            m.get_num_blocks_to_allocate(request_id, self._extent(m, num_tokens, lookahead), blocks)
            for m, blocks in zip(self.managers, hit.blocks, strict=True)
        )
        return need + self.cow.extra_blocks(hit)

    def save_new_computed_blocks(self, request_id: str, hit: CacheHit) -> None:
        for m, blocks in zip(self.managers, hit.blocks, strict=True):
            m.save_new_computed_blocks(request_id, blocks)
        self.cow.adopt(request_id, hit)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, lookahead: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            m.allocate_new_blocks(request_id, self._extent(m, num_tokens, lookahead)) for m in self.managers
        )

    @staticmethod
    def _extent(m: SingleTypeKVCacheManager, num_tokens: int, lookahead: int) -> int:
        """Tokens group ``m`` allocates for: a recurrent group's running page is where the step's state
        ends, never moved by slots reserved ahead for a drafter (which has attention layers only)."""
        return num_tokens if isinstance(m, MambaManager) else num_tokens + lookahead

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish attention blocks full after this step (same-step sharing is safe for them)."""
        for m in self.eager_cachers:
            m.cache_blocks(request, num_tokens)

    def cache_recurrent_blocks(self, request: Request) -> None:
        """Publish recurrent checkpoints reached by steps that have run."""
        for m in self.recurrent:
            m.cache_blocks(request, request.num_computed_tokens)
        if self.fine is not None:
            self.fine.after_step(request)

    def uncache_blocks_from(self, request: Request, num_tokens: int) -> None:
        for m in self.eager_cachers:
            m.uncache_blocks_from(request, num_tokens)

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...] | None:
        """Free columns no group will read again; per-group removed indices, or None."""
        out = None
        for m in self.skippers:
            removed = m.remove_skipped_blocks(request_id, num_computed_tokens)
            if removed:
                if out is None:
                    out = tuple([] for _ in range(self.num_groups))
                out[m.group_id].extend(removed)
        return out

    def state_copies(self, num_computed_tokens: int, num_tokens: int) -> dict[int, tuple[int, int]] | None:
        out = None
        for m in self.recurrent:
            c = m.state_copy(num_computed_tokens, num_tokens)
            if c is not None:
                if out is None:
                    out = {}
                out[m.group_id] = c
        return out

    def token_horizon(self, request_id: str) -> int:
        return min(m.token_horizon(request_id, self.enable_caching) for m in self.managers)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)
        self.cow.free(request_id)
        if self.fine is not None:
            self.fine.free(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.get_block_ids(request_id) for m in self.managers)
