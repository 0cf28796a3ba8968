"""The block pool: fixed-size blocks with refcounts, a free queue and a prefix-hash index.

Idea (vLLM's block pool): a block is free when no request references it (`ref_cnt == 0`), and
a free block may still be *cached*: it keeps its hash, and a later request with the same prefix
takes it back out of the free queue. Its memory is only "evicted" (hash dropped) at the moment
another allocation hands it out, so a prefix stays reusable until the memory is really needed.

The free queue is an intrusive doubly linked list (prev/next live on the block; fake head and
tail) so removing a cache hit from the middle is O(1) and no Python object is allocated per
operation. One queue, two policies: blocks with no hash can never be hit, so they go to the
front (LIFO, reused first); hashed blocks go to the back (LRU, kept as long as possible).
Callers free a request's blocks tail first, because a child hash is unreachable without its
parent, so children should be evicted before parents.

Invariants (checked by `check_invariants`, used by the property tests):
- ref_cnt >= 0; a block is in the free queue iff ref_cnt == 0 and it is not the null block.
- The null block (id 0, taken at start-up) is never in the free queue and never hashed.
- `block.block_hash is not None` iff the block is in the hash index under that key.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenos.core.hashing import BlockHash

# Key in the hash index: the block hash followed by the 4-byte group id.
BlockHashWithGroupId = bytes

_GROUP_SUFFIX = [i.to_bytes(4, "big") for i in range(64)]


def group_key(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + _GROUP_SUFFIX[group_id]


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null", "generation")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Bumped each time the block is handed out: (block, generation) names one content.
        self.generation = 0
        self.block_hash: BlockHashWithGroupId | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks; popleft is the eviction end."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        b = self.head.next_free
        if b is self.tail or b is None:
            raise ValueError("no free blocks")
        self.remove(b)
        return b

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        b = self.head.next_free
        for _ in range(n):
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        self.head.next_free = b
        b.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, b: KVCacheBlock) -> None:
        prev, nxt = b.prev_free, b.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{b} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free_blocks += 1

    def appendleft(self, b: KVCacheBlock) -> None:
        first = self.head.next_free
        first.prev_free = b
        b.next_free = first
        b.prev_free = self.head
        self.head.next_free = b
        self.num_free_blocks += 1

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


class BlockHashToBlockMap:
    """hash -> block, tolerating duplicates (two blocks with equal content computed separately).

    A value is a single block (the common case, no extra object) or a dict block_id -> block.
    """

    def __init__(self) -> None:
        self._map: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        v = self._map.get(key)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        v = self._map.get(key)
        if v is None:
            self._map[key] = block
        elif type(v) is KVCacheBlock:
            self._map[key] = {v.block_id: v, block.block_id: block}
        else:
            v[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        v = self._map.get(key)
        if v is None:
            return None
        if type(v) is KVCacheBlock:
            if v.block_id != block_id:
                return None
            del self._map[key]
            return v
        b = v.pop(block_id, None)
        if len(v) == 1:
            self._map[key] = next(iter(v.values()))
        return b

    def items(self):
        for key, v in self._map.items():
            if type(v) is KVCacheBlock:
                yield key, v
            else:
                for b in v.values():
                    yield key, b

    def __len__(self) -> int:
        return len(self._map)

    def clear(self) -> None:
        self._map.clear()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the block pool needs at least 2 blocks (one is the null block), got {num_blocks}."
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Burned at start-up: "no block here" is an ordinary block id (0), never freed.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1

    # ------------------------------------------------------------------ lookup

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash + _GROUP_SUFFIX[group_id])

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> None:
        """Publish `block` under `block_hash` for `group_id` (its contents must match by the time
        anyone reads them: same-step for attention, after the step for recurrent state)."""
        assert block.block_hash is None and not block.is_null, block
        key = block_hash + _GROUP_SUFFIX[group_id]
        block.block_hash = key
        self.cached_block_hash_to_block.insert(key, block)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop a block's hash (its contents will not match after all, e.g. a cancelled step)."""
        if block.block_hash is not None:
            self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
            block.block_hash = None

    # ------------------------------------------------------------------ allocation

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the eviction end, evicting their hashes now (lazy eviction)."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for b in blocks:
            if b.block_hash is not None:
                self.cached_block_hash_to_block.pop(b.block_hash, b.block_id)
                b.block_hash = None
            b.ref_cnt = 1
            b.generation += 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for b in blocks:
            if b.is_null:
                continue
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass them in eviction order (a request's tail first)."""
        q = self.free_block_queue
        for b in ordered_blocks:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    q.appendleft(b)
                else:
                    q.append(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no block is in use (else False: hashes of live blocks
        must stay consistent with what requests expect)."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.block_hash = None
        return True

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by some request (cached free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        free_ids = set()
        for b in self.free_block_queue:
            assert b.block_id not in free_ids, f"{b} twice in the free queue"
            free_ids.add(b.block_id)
            assert b.ref_cnt == 0, f"{b} is free but referenced"
        assert len(free_ids) == self.free_block_queue.num_free_blocks
        assert self.null_block.block_id not in free_ids and self.null_block.block_hash is None
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative refcount"
            if b.ref_cnt == 0:
                assert b.block_id in free_ids, f"{b} is unreferenced but not free"
        n = 0
        for key, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == key, f"{b} is indexed under another hash"
            n += 1
        assert n == sum(b.block_hash is not None for b in self.blocks)
