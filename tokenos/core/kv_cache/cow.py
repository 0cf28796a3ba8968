"""Copy-on-write columns of a new request's hit: a page it may read but must not write in place.

Two kinds of hit give a request a page it shares with someone else in a column it will WRITE:
- a fine-grained prefix hit between attention page boundaries (see `fine_prefix`): the partial
  attention page, and a recurrent checkpoint that is not on the group's own grid;
- a fork (n > 1 siblings, see `KVCacheCoordinator.fork_hit`): the parent's partial attention page
  and its running recurrent page, which the parent keeps updating in place.

For each such column the request gets a fresh private page and the worker copies the shared source
into it before anything else in the step (`SchedulerOutput.prefix_page_copies`). The request holds
a reference on every source until the step that copies has run, so a source is never handed out
and rewritten before its copy read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenos.core.kv_cache.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from tokenos.core.kv_cache.single_type_manager import SingleTypeKVCacheManager


@dataclass(frozen=True)
class CacheHit:
    """What a request may resume from: per group its hit blocks, the hit length in tokens, and the
    columns (group id -> column) whose block is a copy-on-write source rather than the request's own."""

    blocks: tuple[list[KVCacheBlock], ...]
    num_tokens: int
    cow: dict[int, int] = field(default_factory=dict)

    @classmethod
    def miss(cls, num_groups: int) -> CacheHit:
        return cls(tuple([] for _ in range(num_groups)), 0)


class CopyOnWrite:
    def __init__(self, managers: tuple[SingleTypeKVCacheManager, ...], block_pool: BlockPool) -> None:
        self.managers = {m.group_id: m for m in managers}
        self.pool = block_pool
        self.borrowed: dict[str, list[KVCacheBlock]] = {}  # sources held until the copy ran
        self.pending: dict[str, dict[int, tuple[int, int]]] = {}  # copies for the next step

    @staticmethod
    def extra_blocks(hit: CacheHit) -> int:
        """Fresh private pages a hit needs for its copy-on-write columns."""
        return len(hit.cow)

    def adopt(self, request_id: str, hit: CacheHit) -> None:
        """After the managers took the hit: swap each copy-on-write source for a fresh page (the
        source keeps the reference it got) and queue the copy for the request's first step."""
        cow = hit.cow
        if not cow:
            return
        copies = self.pending.setdefault(request_id, {})
        held = self.borrowed.setdefault(request_id, [])
        for gid, col in cow.items():
            m = self.managers[gid]
            blocks = m.req_to_blocks[request_id]
            src = blocks[col]
            blocks[col] = self.pool.get_new_blocks(1)[0]
            held.append(src)
            copies[gid] = (src.block_id, col)
            # The private page is not published yet: it is cached when it becomes full.
            m.num_cached_block[request_id] = min(m.num_cached_block.get(request_id, 0), col)

    def take_copies(self, request_id: str) -> dict[int, tuple[int, int]] | None:
        return self.pending.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request's first step (which did the copies) has run: give the sources back."""
        held = self.borrowed.pop(request_id, None)
        if held:
            self.pool.free_blocks(held)

    def free(self, request_id: str) -> None:
        self.release(request_id)
        self.pending.pop(request_id, None)
