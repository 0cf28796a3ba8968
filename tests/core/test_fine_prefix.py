"""Fine-grained hybrid prefix caching (tokenos/core/kv_cache/fine_prefix.py): a checkpoint interval
independent of the attention page, sub-page hits with copy-on-write, exact end-of-request checkpoints.
Driven through the real scheduler and the contract-checking fake worker."""

from __future__ import annotations

import pytest

from tests.fixtures.scheduler_sim import attn, make_engine, make_request, mamba, step
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, MambaSpec, get_kv_cache_config

make = make_engine


def run_one(s, w, checker, req):
    """Run `req` alone to the end; returns the first step's SchedulerOutput."""
    s.add_request(req)
    first = None
    while s.has_unfinished_requests():
        out, _ = step(s, w, checker)
        first = first or out
    return first


def test_interval_is_independent_of_the_attention_page() -> None:
    specs = {"a": FullAttentionSpec(16, 1, 8, "float32"), "m": MambaSpec(((3, 8),), ("float32",), 16)}
    cfg = get_kv_cache_config(
        specs, available_memory_bytes=None, num_blocks=64, max_model_len=64, mamba_checkpoint_interval=4
    )
    assert cfg.kernel_block_sizes == [16, 4]
    assert cfg.hash_block_size == 4 and cfg.scheduler_alignment == 4
    pages = {g.kv_cache_spec.page_size_bytes for g in cfg.kv_cache_groups}
    assert len(pages) == 1  # the interval is tokens, the page bytes: one pool still
    with pytest.raises(ValueError, match="neither divides"):
        get_kv_cache_config(
            specs, available_memory_bytes=None, num_blocks=64, max_model_len=64, mamba_checkpoint_interval=6
        )


def test_default_is_unchanged() -> None:
    s, w, checker = make(attn(8), mamba(8, "align"))
    assert s.kv_cache_manager.fine is None
    out = run_one(s, w, checker, make_request("a", list(range(1, 20))))
    assert out.prefix_page_copies == {}


def test_sub_page_hit_copies_the_partial_page() -> None:
    """Checkpoints every 4 tokens in 8-token pages: a prompt sharing 14 tokens resumes at 12, sharing
    page 0 and copying the first 4 slots of page 1 (copy-on-write) from the first request's page."""
    s, w, checker = make(attn(8), mamba(4, "all"))
    shared = list(range(1, 15))
    run_one(s, w, checker, make_request("a", shared + [40, 41, 42], max_tokens=2))
    out = run_one(s, w, checker, make_request("b", shared + [30, 31], max_tokens=2))
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12
    src, dst = out.prefix_page_copies["b"][0]
    assert dst == 1 and src != new.block_ids[0][1]
    assert 1 not in out.prefix_page_copies["b"]  # 12 is an interval boundary: no recurrent copy
    checker.check_all_free()
    assert s.make_stats()["prefix_cache_hits"] == 12


def test_source_page_is_held_until_the_copy_ran() -> None:
    s, w, checker = make(attn(8), mamba(4, "all"))
    shared = list(range(1, 15))
    run_one(s, w, checker, make_request("a", shared + [40], max_tokens=1))
    s.add_request(make_request("b", shared + [30, 31, 32], max_tokens=4))
    out = s.schedule()
    src, _ = out.prefix_page_copies["b"][0]
    pool = s.kv_cache_manager.block_pool
    assert pool.blocks[src].ref_cnt == 1  # borrowed, in no block list: not reusable before the copy
    s.update_from_output(out, w.execute(out))
    checker.check()
    assert pool.blocks[src].ref_cnt == 0  # the copy ran: back to the evictable cache
    assert src not in s.kv_cache_manager.get_block_ids("b")[0]
    while s.has_unfinished_requests():
        step(s, w, checker)
    assert s.kv_cache_manager.block_pool.blocks[src].ref_cnt == 0
    checker.check_all_free()


@pytest.mark.parametrize("mode", ["align", "all"])
def test_exact_end_checkpoint_resumes_the_next_turn(mode) -> None:
    """Turn 2 = turn 1's prompt + answer + new text resumes at turn 1's last computed token
    (prompt + answer - 1: the last sampled token was never fed back), off every block boundary."""
    at_end = CacheConfig(mamba_checkpoint_at_end=True)
    s, w, checker = make(attn(8), mamba(8 if mode == "align" else 4, mode), cache=at_end)
    turn1 = make_request("t1", list(range(1, 12)), max_tokens=4)
    run_one(s, w, checker, turn1)
    end = turn1.num_tokens - 1
    assert end % 4
    turn2 = make_request("t2", turn1.all_token_ids + [45, 46], max_tokens=4)
    out = run_one(s, w, checker, turn2)
    assert out.scheduled_new_reqs[0].num_computed_tokens == end
    assert set(out.prefix_page_copies["t2"]) == {0, 1}  # partial attention page and mid-column state
    turn3 = make_request("t3", turn2.all_token_ids + [47], max_tokens=3)
    out = run_one(s, w, checker, turn3)
    assert out.scheduled_new_reqs[0].num_computed_tokens == turn2.num_tokens - 1
    checker.check_all_free()


def test_end_checkpoint_needs_the_flag() -> None:
    s, w, checker = make(attn(8), mamba(4, "all"))
    turn1 = make_request("t1", list(range(1, 12)), max_tokens=4)
    run_one(s, w, checker, turn1)
    out = run_one(s, w, checker, make_request("t2", turn1.all_token_ids + [45], max_tokens=1))
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12  # the last interval boundary only


def test_preempted_request_resumes_from_its_checkpoint() -> None:
    """A preempted request comes back at its latest surviving checkpoint, not at zero."""
    s, w, checker = make(attn(8), mamba(4, "all"), num_blocks=20, budget=8)
    reqs = [make_request(f"r{i}", [i + 1] * 3 + list(range(10 + i, 19 + i)), max_tokens=30) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    resumed = []
    while s.has_unfinished_requests():
        out, _ = step(s, w, checker)
        resumed += [n.num_computed_tokens for n in out.scheduled_new_reqs if n.output_token_ids]
    assert s.num_preemptions > 0
    assert resumed and max(resumed) > 0
    checker.check_all_free()


def test_all_mode_keeps_checkpoints_cached_not_pinned() -> None:
    """ "all" mode writes a checkpoint every interval, but a running request holds only its previous
    and running recurrent pages: the published ones wait in the evictable cache, and still hit."""
    s, w, checker = make(attn(8), mamba(4, "all"), budget=16)
    long = make_request("long", list(range(1, 42)), max_tokens=20)
    s.add_request(long)
    while long.num_computed_tokens < long.num_prompt_tokens:
        step(s, w, checker)
    step(s, w, checker)  # a decode step: the checkpoints of the prompt's last chunk are freed too
    held = [b for b in s.kv_cache_manager.get_block_ids("long")[1] if b]
    assert len(held) <= 2  # not ceil(41 / 4) = 11 pinned pages
    other = make_request("other", list(range(1, 30)) + [7, 7], max_tokens=2)
    out = run_one(s, w, checker, other)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 28  # the last interval checkpoint shared
    while s.has_unfinished_requests():
        step(s, w, checker)
    checker.check_all_free()
