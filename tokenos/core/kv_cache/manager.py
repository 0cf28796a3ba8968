"""The memory manager the scheduler talks to: prefix lookup, slot allocation, freeing. The scheduler
uses only this class's public methods; everything below it (coordinator, managers, pool) is private.

It wraps the coordinator with the request-level rules:
- the hit is capped at `num_tokens - 1`, so the last token is always computed (its logits are
  needed) and a full hit never leaves a zero-length step;
- with `hit_needs_next_token` (an MTP drafter, whose K/V at position i holds token i + 1) the hit is
  looked up again below the first one found, so the token at the hit boundary is inside the matched
  prefix too: the drafter's K/V at the last reused position was written with this request's next token;
- requests asking for prompt logprobs skip the lookup (every prompt position must be computed);
- `allocate_slots` is all-or-nothing: it checks the free-block count for the whole need
  (optionally a larger reservation, e.g. the whole prompt at admission) before touching the pool,
  and says which with a typed `Allocation`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenos.core.hashing import get_hash_fn, make_block_hasher
from tokenos.core.kv_cache.coordinator import KVCacheCoordinator
from tokenos.core.kv_cache.cow import CacheHit
from tokenos.core.kv_cache.fine_prefix import FinePrefixCache
from tokenos.core.kv_cache.spec import KVCacheConfig
from tokenos.core.request import Request

# One list of block ids per KV-cache group, in group order.
BlockIds = tuple[list[int], ...]


@dataclass(frozen=True, slots=True)
class Allocation:
    """The outcome of `allocate_slots`: ``ok`` False means the pool was short and nothing changed;
    ``new_block_ids`` are the blocks appended to each group (None: none)."""

    ok: bool
    new_block_ids: BlockIds | None = None


NO_NEW_BLOCKS = Allocation(ok=True)
OUT_OF_BLOCKS = Allocation(ok=False)


class KVCacheManager:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        checkpoint_at_end: bool = False,
        hit_needs_next_token: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.coordinator = KVCacheCoordinator(kv_cache_config, enable_caching)
        self.enable_caching = self.coordinator.enable_caching
        self.block_pool = self.coordinator.block_pool
        self.num_groups = self.coordinator.num_groups
        self.block_hasher = make_block_hasher(kv_cache_config.hash_block_size, get_hash_fn(hash_algo))
        self.fine = self._make_fine(kv_cache_config, get_hash_fn(hash_algo), checkpoint_at_end)
        self.coordinator.fine = self.fine
        self.has_recurrent_caching = self.enable_caching and bool(self.coordinator.recurrent)
        self.has_recurrent = bool(self.coordinator.recurrent)
        self.has_skipping = bool(self.coordinator.skippers)
        self.cow = self.coordinator.cow
        self.hit_needs_next_token = hit_needs_next_token
        self.miss = CacheHit.miss(self.num_groups)
        # request id -> token count reachable without allocating or publishing (fast path).
        self._horizon: dict[str, int] = {}
        # Cumulative prefix-cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Hit tokens by source: "block" (full blocks); hybrids: "checkpoint" / "end_checkpoint".
        self.hits_by_source: dict[str, int] = {}
        # Pages each group took from the cache on hits (recurrent groups: the one state page resumed
        # from; sliding windows: the pages inside the window): which groups a hit really reuses.
        self.hit_pages_by_group = [0] * self.num_groups

    def _make_fine(self, config: KVCacheConfig, hash_fn, checkpoint_at_end: bool) -> FinePrefixCache | None:
        """Fine-grained hybrid hits: end checkpoints (on by default), or a recurrent checkpoint
        interval different from the attention page size. Without either: vLLM's behaviour."""
        coord = self.coordinator
        if not self.enable_caching or not coord.recurrent:
            return None
        sizes = {m.block_size for m in coord.managers}
        if len(sizes) == 1 and (not checkpoint_at_end or coord.has_sliding_window):
            return None  # end checkpoints are not supported beside sliding windows: skip them
        return FinePrefixCache(
            coord.managers, self.block_pool, config.hash_block_size, hash_fn, checkpoint_at_end
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """The request's longest usable prefix hit (a miss of 0 tokens when there is none)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.miss
        hit = self._find(request, request.num_tokens - 1)
        if self.hit_needs_next_token and hit.num_tokens:
            # The tokens matched cover [0, hit); one lower boundary has its next token among them.
            hit = self._find(request, hit.num_tokens - 1)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += hit.num_tokens
        if hit.num_tokens:
            source = self.fine.last_source if self.fine is not None else "block"
            self.hits_by_source[source] = self.hits_by_source.get(source, 0) + hit.num_tokens
            for gid, blocks in enumerate(hit.blocks):
                self.hit_pages_by_group[gid] += sum(1 for b in blocks if not b.is_null)
        return hit

    def _find(self, request: Request, max_length: int) -> CacheHit:
        if self.fine is not None:
            return self.fine.find(request, max_length)
        return self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)

    def pages_by_group(self) -> list[int]:
        """Pages (other than the null block) held by requests, per KV-cache group; a page shared by
        several requests (a prefix hit, a fork) counts once. A walk over every request's blocks: for a
        metrics scrape, not for every step."""
        pages = []
        for m in self.coordinator.managers:
            held = {b.block_id for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null}
            pages.append(len(held))
        return pages

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_tokens_to_reserve: int = 0,
        num_draft_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> Allocation:
        """Blocks for `num_new_tokens` more tokens after the computed ones (and, for a request being
        admitted, after its `hit`, which it takes). Not ok when the pool cannot supply
        max(need, reservation) blocks; then nothing changed. The last `num_draft_tokens` of the new
        tokens are speculative: they get slots, but no block is published on their account.
        `num_lookahead_tokens` more slots after them are for a drafter's K/V while it proposes: attention
        groups only, publishing nothing (a recurrent group's running page stays where the step ends)."""
        rid = request.request_id
        num_hit = 0 if hit is None else hit.num_tokens
        num_tokens = request.num_computed_tokens + num_hit + num_new_tokens
        # Fast path (most decode steps): every group already has the pages for `num_tokens`
        # and no block becomes full, so nothing to allocate or publish.
        look = num_lookahead_tokens
        if num_tokens + look <= self._horizon.get(rid, -1) and not num_tokens_to_reserve and hit is None:
            return NO_NEW_BLOCKS
        coord = self.coordinator
        need = coord.get_num_blocks_to_allocate(rid, max(num_tokens, num_tokens_to_reserve), hit, look)
        if need > self.block_pool.free_block_queue.num_free_blocks:
            return OUT_OF_BLOCKS
        if hit is not None and num_hit:
            coord.save_new_computed_blocks(rid, hit)
        new = coord.allocate_new_blocks(rid, num_tokens, look)
        if self.enable_caching:
            coord.cache_blocks(request, num_tokens - num_draft_tokens)
        self._horizon[rid] = coord.token_horizon(rid)
        for blocks in new:
            if blocks:
                return Allocation(ok=True, new_block_ids=tuple([b.block_id for b in blks] for blks in new))
        return NO_NEW_BLOCKS

    def remove_skipped_blocks(self, request: Request) -> tuple[list[int], ...] | None:
        """Free the request's columns outside the window / older than the previous state."""
        if not self.has_skipping:
            return None
        return self.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def state_copies(self, num_computed_tokens: int, num_tokens: int) -> dict[int, tuple[int, int]] | None:
        if not self.has_recurrent:
            return None
        return self.coordinator.state_copies(num_computed_tokens, num_tokens)

    def take_prefix_page_copies(self, request: Request) -> dict[int, tuple[int, int]] | None:
        """Copy-on-write copies the request's hit (prefix or fork) needs before its first step."""
        return self.cow.take_copies(request.request_id)

    def after_step(self, request: Request, publish: bool = True) -> None:
        """A step of the request has run and its tokens are appended: publish the recurrent checkpoints
        it reached (not with ``publish`` False: its pages may hold a state past the computed tokens), and
        give back the copy-on-write sources its first step copied."""
        if publish and self.has_recurrent_caching:
            self.coordinator.cache_recurrent_blocks(request)
        if self.cow.borrowed:
            self.cow.release(request.request_id)

    def fork_hit(self, parent: Request, fork_point: int) -> CacheHit:
        """A sibling's hit on its running parent's pages after `fork_point` tokens (see
        `KVCacheCoordinator.fork_hit`); the parent must not have advanced past the fork point."""
        return self.coordinator.fork_hit(parent.request_id, fork_point)

    def free(self, request: Request, publish_end: bool = True) -> None:
        """Give back a request that finished, was aborted or preempted between steps: every step
        counted in its computed tokens has run, so (end checkpoints on) the exact state after them
        is published first, for the next turn or its own resumption (not with ``publish_end`` False: a
        stop inside verified drafts left the running state past the computed tokens)."""
        if publish_end and self.fine is not None:
            self.fine.publish_end(request)
        self._release(request)

    def free_unfinished_step(self, request: Request) -> None:
        """Free a request whose scheduled step is cancelled (preempted in the same schedule):
        blocks published for that step never get written, so their hashes are dropped first."""
        if self.enable_caching:
            self.coordinator.uncache_blocks_from(request, request.num_computed_tokens)
        self._release(request)

    def free_failed_step(self, request: Request, step_start: int) -> None:
        """Free a request the worker failed in the step that took it from ``step_start`` tokens: what
        that step wrote is not trusted (a LoRA adapter that did not load ran its rows as the base
        model), so the blocks it filled leave the prefix cache and no end state is published."""
        if self.enable_caching:
            self.coordinator.uncache_blocks_from(request, step_start)
        self._release(request)

    def _release(self, request: Request) -> None:
        self._horizon.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()  # only succeeds with no request holding blocks
