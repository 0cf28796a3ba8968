"""Block pool (free queue order, lazy eviction, duplicates, reset, usage) and prefix hashing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenos.core.hashing import get_hash_fn, hash_block_tokens, make_block_hasher
from tokenos.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tokenos.core.messages import EngineSamplingParams
from tokenos.core.request import Request

H = get_hash_fn("sha256")


def test_null_block_taken_at_start():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    pool.free_blocks([pool.null_block])  # never freed
    pool.touch([pool.null_block])
    assert pool.get_num_free_blocks() == 4
    pool.check_invariants()
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, enable_caching=True)


def test_free_queue_is_intrusive_with_o1_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.appendleft(blocks[2])
    q.append(q.popleft())
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.popleft_n(3)] == [0, 1, 3]
    with pytest.raises(ValueError):
        q.popleft_n(3)


def test_unhashed_reused_first_hashed_last_and_tail_first():
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)  # a request's blocks: two full and hashed, one partial
    pool.cache_block(a[0], b"h0", 0)
    pool.cache_block(a[1], b"h1", 0)
    pool.free_blocks(reversed(a))  # tail first
    order = [b.block_id for b in pool.free_block_queue]
    # the unhashed tail goes to the front; hashed ones to the back, child before parent
    assert order[0] == a[2].block_id
    assert order[-2:] == [a[1].block_id, a[0].block_id]
    pool.check_invariants()


def test_lazy_eviction_and_hit_from_free_queue():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"x", 0)
    pool.free_blocks([b])
    assert pool.get_cached_block(b"x", 0) is b  # free but still cached
    assert pool.get_cached_block(b"x", 1) is None  # other group
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    got = pool.get_new_blocks(3)  # takes every free block: evicts b's hash now
    assert b in got and b.block_hash is None and pool.get_cached_block(b"x", 0) is None
    pool.free_blocks(got)
    pool.check_invariants()


def test_duplicate_hashes_tolerated():
    pool = BlockPool(5, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, b"same", 0)
    pool.cache_block(b2, b"same", 0)
    assert pool.get_cached_block(b"same", 0) in (b1, b2)
    pool.free_blocks([b1, b2])
    pool.get_new_blocks(4)  # evict both
    assert pool.get_cached_block(b"same", 0) is None
    pool.check_invariants()


def test_reset_prefix_cache_and_usage():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.cache_block(blocks[0], b"k", 0)
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"k", 0) is None and blocks[0].block_hash is None
    pool.check_invariants()


# ---------------------------------------------------------------- hashing


def _req(tokens, salt=None, adapter=None, bs=4, algo="sha256"):
    return Request(
        "r",
        tokens,
        EngineSamplingParams(),
        cache_salt=salt,
        adapter_id=adapter,
        block_hasher=make_block_hasher(bs, get_hash_fn(algo)),
    )


@pytest.mark.parametrize("algo", ["sha256", "xxhash", "blake2b"])
def test_chained_hashes_and_incremental_equals_full(algo):
    full = _req(list(range(10)), algo=algo)
    assert len(full.block_hashes) == 2
    inc = _req(list(range(3)), algo=algo)
    assert inc.block_hashes == []
    for t in range(3, 10):
        inc.append_output_token_ids(t)
    assert inc.block_hashes == full.block_hashes
    # chained: same tokens after a different prefix hash differently
    other = _req([9, 9, 9, 9, 4, 5, 6, 7], algo=algo)
    assert other.block_hashes[1] != full.block_hashes[1]


def test_salt_first_block_only_and_adapter_on_every_block():
    plain = _req(list(range(8)))
    salted = _req(list(range(8)), salt="tenant")
    assert salted.block_hashes[0] != plain.block_hashes[0]
    f = get_hash_fn("sha256")
    # the salt enters block 0's extra keys only; block 1's difference comes from the chain
    assert salted.block_hashes[1] == hash_block_tokens(f, salted.block_hashes[0], [4, 5, 6, 7])
    adapted = _req(list(range(8)), adapter=3)
    assert adapted.block_hashes[1] != hash_block_tokens(f, adapted.block_hashes[0], [4, 5, 6, 7])


def test_hashes_stable_across_processes_and_hash_seeds():
    code = (
        "from tokenos.core.hashing import get_hash_fn, hash_block_tokens;"
        "print(hash_block_tokens(get_hash_fn('sha256'), None, [1, 2, 3], ('a', 'salt')).hex())"
    )
    outs = set()
    for seed in ("0", "123"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == hash_block_tokens(H, None, [1, 2, 3], ("a", "salt")).hex()
