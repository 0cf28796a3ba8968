"""Per-spec managers and the hybrid coordinator: hits, the fixed point, windows, checkpoints."""

from __future__ import annotations

import pytest

from tests.fixtures.scheduler_sim import attn, make_config, mamba, swa
from tokenos.core.hashing import get_hash_fn, make_block_hasher
from tokenos.core.kv_cache.manager import Allocation, KVCacheManager
from tokenos.core.messages import EngineSamplingParams
from tokenos.core.request import Request


def _setup(*specs, num_blocks=64, caching=True):
    cfg = make_config(num_blocks, *specs)
    kv = KVCacheManager(cfg, max_model_len=256, enable_caching=caching)
    return kv


def _req(kv, rid, tokens, **sp):
    hasher = make_block_hasher(kv.kv_cache_config.hash_block_size, get_hash_fn("sha256"))
    return Request(rid, tokens, EngineSamplingParams(**sp), block_hasher=hasher)


def _publish(kv, req, group, columns):
    """Pretend some earlier request left cached pages for these columns of `group`."""
    pool = kv.block_pool
    blocks = pool.get_new_blocks(len(columns))
    for b, j in zip(blocks, columns, strict=True):
        pool.cache_block(b, req.block_hashes[j], group)
    pool.free_blocks(blocks)
    return blocks


@pytest.mark.parametrize(
    "attn_cols, mamba_cols, want",
    [
        (range(8), [7], 32),  # both at 32 tokens
        (range(8), [3], 16),  # recurrent checkpoint only at 16
        (range(4), [3, 7], 16),  # attention K/V only up to 16
        (range(4), [7], 0),  # no checkpoint where attention ends: nothing to resume from
        (range(8), [1, 5], 24),  # latest checkpoint below the attention hit
        (range(8), [], 0),
    ],
)
def test_hybrid_hit_is_the_boundary_every_group_shares(attn_cols, mamba_cols, want):
    kv = _setup(attn(4), mamba(4))
    req = _req(kv, "r", list(range(40)))
    _publish(kv, req, 0, list(attn_cols))
    if mamba_cols:
        _publish(kv, req, 1, mamba_cols)
    found = kv.coordinator.find_longest_cache_hit(req.block_hashes, 32)
    blocks, hit = found.blocks, found.num_tokens
    assert hit == want
    if hit:
        assert len(blocks[0]) == hit // 4 and not any(b.is_null for b in blocks[0])
        # recurrent: earlier columns are null, the checkpoint sits at the last one
        assert all(b.is_null for b in blocks[1][:-1]) and not blocks[1][-1].is_null


def test_fixed_point_needs_more_than_one_trim():
    # sliding window needs 2 contiguous blocks before the boundary; recurrent a checkpoint.
    kv = _setup(swa(4, 6), mamba(4))
    req = _req(kv, "r", list(range(40)))
    _publish(kv, req, 0, [0, 1, 2, 4, 5])  # column 3 missing
    _publish(kv, req, 1, [2, 5])
    # candidate 32 -> sliding 24 (cols 4,5) -> recurrent 24 (col 5) -> agreed
    assert kv.coordinator.find_longest_cache_hit(req.block_hashes, 32).num_tokens == 24
    kv2 = _setup(swa(4, 6), mamba(4))
    _publish(kv2, req, 0, [0, 1, 2, 4, 5])
    _publish(kv2, req, 1, [2, 4])
    # sliding 24 -> recurrent 20 (col 4) -> sliding at 20 needs cols 3,4: col 3 missing, so 12
    # -> recurrent 12 (col 2) -> sliding 12 (cols 1,2) -> agreed at 12
    assert kv2.coordinator.find_longest_cache_hit(req.block_hashes, 32).num_tokens == 12


def test_hit_capped_below_the_whole_prompt_and_prompt_logprobs_skip():
    kv = _setup(attn(4))
    req = _req(kv, "r", list(range(16)))
    _publish(kv, req, 0, range(4))
    assert (
        kv.get_computed_blocks(req).num_tokens == 12
    )  # 16 would leave nothing to compute: the last block is recomputed
    req2 = _req(kv, "r2", list(range(16)), prompt_logprobs=1)
    assert kv.get_computed_blocks(req2).num_tokens == 0


def test_sliding_window_frees_blocks_outside_the_window():
    kv = _setup(swa(4, 6))
    req = _req(kv, "r", list(range(30)))
    assert kv.allocate_slots(req, 24).new_block_ids == ([1, 2, 3, 4, 5, 6],)
    req.num_computed_tokens = 24
    removed = kv.remove_skipped_blocks(req)
    # next query at 24 reads keys 19..24: columns 0..3 (tokens < 16) are dead
    assert removed == ([3, 2, 1, 0],)
    assert kv.get_block_ids("r") == ([0, 0, 0, 0, 5, 6],)
    assert kv.remove_skipped_blocks(req) is None
    kv.free(req)
    kv.block_pool.check_invariants()
    assert kv.block_pool.get_num_free_blocks() == 63


def test_mamba_align_keeps_previous_and_running_pages_only():
    kv = _setup(mamba(4, "align"))
    req = _req(kv, "r", list(range(40)))
    assert kv.allocate_slots(req, 8).new_block_ids == ([0, 1],)  # running column 1; column 0 never needed
    assert kv.state_copies(0, 8) is None
    req.num_computed_tokens = 8
    assert kv.remove_skipped_blocks(req) is None
    assert kv.allocate_slots(req, 1).new_block_ids == ([2],)  # 9 tokens: running column 2
    assert kv.state_copies(8, 9) == {0: (1, 2)}
    req.num_computed_tokens = 9
    assert kv.remove_skipped_blocks(req) == ([1],)
    assert kv.allocate_slots(req, 3) == Allocation(ok=True)  # 12 tokens: still column 2, in place
    assert kv.state_copies(9, 12) is None
    assert kv.get_block_ids("r") == ([0, 0, 2],)


def test_mamba_none_mode_one_page_and_no_caching():
    kv = _setup(attn(4), mamba(4, "none"))
    assert not kv.enable_caching
    req = _req(kv, "r", list(range(40)))
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    kv.allocate_slots(req, 9)
    ids = kv.get_block_ids("r")
    assert len(ids[0]) == 5 and len(ids[1]) == 1
    assert kv.state_copies(10, 19) is None


def test_recurrent_checkpoints_published_only_after_the_step():
    kv = _setup(attn(4), mamba(4, "align"))
    req = _req(kv, "r", list(range(20)))
    kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    # attention blocks are published at allocation, the checkpoint is not yet
    assert kv.block_pool.get_cached_block(req.block_hashes[1], 0) is not None
    assert kv.block_pool.get_cached_block(req.block_hashes[1], 1) is None
    kv.after_step(req)  # what update_from_output does once the step ran
    assert kv.block_pool.get_cached_block(req.block_hashes[1], 1) is not None


def test_allocation_is_all_or_nothing_and_reserves_the_full_need():
    kv = _setup(attn(4), num_blocks=6)  # 5 usable blocks
    a = _req(kv, "a", list(range(12)))
    assert kv.allocate_slots(a, 12).ok  # 3 blocks
    b = _req(kv, "b", list(range(100, 112)))
    # the first chunk (4 tokens) would fit, but the whole prompt (3 blocks) does not
    assert not kv.allocate_slots(b, 4, num_tokens_to_reserve=12).ok
    assert kv.block_pool.get_num_free_blocks() == 2 and kv.get_block_ids("b") == ([],)
    assert kv.allocate_slots(b, 4, num_tokens_to_reserve=8).ok


def test_lookahead_slots_are_attention_pages_only():
    """A drafter's lookahead slots (its K/V while proposing) extend the attention pages; the recurrent
    running page stays the column where the step's state ends, which the worker reads."""
    kv = _setup(attn(4), mamba(4, "align"))
    req = _req(kv, "r", list(range(40)))
    ids = kv.allocate_slots(req, 7, num_lookahead_tokens=2).new_block_ids
    state = kv.get_block_ids("r")[1]
    assert len(ids[0]) == 3  # 9 attention slots
    assert len(state) == 2 and state[0] == 0 and state[1] != 0  # 7 tokens: the running state in column 1


@pytest.mark.parametrize("recurrent", [False, True], ids=["attention", "hybrid"])
def test_an_mtp_hit_ends_where_the_next_token_matched_too(recurrent):
    """An MTP drafter's K/V at position i holds token i + 1: a hit of h tokens is only exact when token h
    is among the tokens matched, so the lookup goes one boundary back from the first hit it finds."""
    specs = (attn(4), mamba(4)) if recurrent else (attn(4),)
    plain = _setup(*specs)
    mtp = KVCacheManager(make_config(64, *specs), max_model_len=256, hit_needs_next_token=True)
    for kv in (plain, mtp):
        req = _req(kv, "r", list(range(20)))
        _publish(kv, req, 0, range(4))  # 16 tokens of attention pages
        if recurrent:
            _publish(kv, req, 1, [1, 3])  # checkpoints at 8 and 16
    assert plain.get_computed_blocks(_req(plain, "a", list(range(20)))).num_tokens == 16
    # 16 matched tokens, but token 16 is not among them: the hit is 12 (8 on the hybrid's checkpoints).
    assert mtp.get_computed_blocks(_req(mtp, "a", list(range(20)))).num_tokens == (8 if recurrent else 12)


def test_mla_group_is_full_attention_to_the_manager():
    """An MLA group runs the full-attention manager: a finished request's blocks are hit by the next one
    with the same prefix, exactly as for an ordinary attention group."""
    from tokenos.core.kv_cache.single_type_manager import FullAttentionManager
    from tokenos.core.kv_cache.spec import MLAAttentionSpec

    kv = _setup(MLAAttentionSpec(4, 1, 6, "float32"))
    assert type(kv.coordinator.managers[0]) is FullAttentionManager
    first = _req(kv, "a", list(range(14)))
    assert kv.allocate_slots(first, 14).ok
    blocks = kv.get_block_ids("a")[0]
    kv.free(first)
    second = _req(kv, "b", [*range(12), 99, 98, 97])
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 12 and [b.block_id for b in hit.blocks[0]] == blocks[:3]
