"""n > 1 forks: siblings wait for the parent's prompt, then copy its state instead of recomputing.

The fake worker checks every key and every initial recurrent state it reads, so a sibling that
forked from the wrong page, or from a page the parent had already advanced, fails here.
"""

from __future__ import annotations

import pytest

from tests.fixtures.scheduler_sim import LAYOUTS, make_engine, make_request, step
from tokenos.core.kv_cache.spec import MambaSpec
from tokenos.core.request import RequestStatus
from tokenos.core.sched.scheduler import Scheduler


def make(layout: str, **kw):
    return make_engine(*LAYOUTS[layout](), **kw)


def add_family(s: Scheduler, prompt: list[int], n: int, max_tokens: int = 6) -> list:
    reqs = [
        make_request(
            "p" if k == 0 else f"p.{k}",
            prompt,
            max_tokens=max_tokens,
            ignore_eos=True,
            fork_of=None if k == 0 else "p",
        )
        for k in range(n)
    ]
    for r in reqs:
        s.add_request(r)
    return reqs


def drain(s, w, checker) -> list:
    outs = []
    while s.has_unfinished_requests():
        out, _ = step(s, w, checker)
        outs.append(out)
    return outs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_siblings_fork_from_the_parent_at_the_last_prompt_token(layout) -> None:
    s, w, checker = make(layout)
    prompt = list(range(1, 14))  # 13 tokens: the fork point 12 is off every block boundary
    reqs = add_family(s, prompt, 3)
    while reqs[0].num_computed_tokens < 12:  # the parent alone, and it stops at the fork point
        out, _ = step(s, w, checker)
        assert set(out.num_scheduled_tokens) == {"p"}
    assert reqs[0].num_computed_tokens == 12
    assert s.get_num_unfinished_requests() == 3
    out, _ = step(s, w, checker)
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {"p.1": 12, "p.2": 12}
    assert out.num_scheduled_tokens == {"p": 1, "p.1": 1, "p.2": 1}  # 15 tokens computed instead of 39
    groups = s.kv_cache_manager.kv_cache_config.kv_cache_groups
    recurrent = {g for g, spec in enumerate(groups) if isinstance(spec.kv_cache_spec, MambaSpec)}
    partial = {
        g for g, spec in enumerate(groups) if g not in recurrent and 12 % spec.kv_cache_spec.block_size
    }
    for sib in ("p.1", "p.2"):
        # Every recurrent state is copied; an attention page only where 12 tokens end mid-page.
        assert set(out.prefix_page_copies.get(sib, {})) == recurrent | partial
    drain(s, w, checker)
    assert all(r.num_output_tokens == 6 for r in reqs)
    # Same deterministic fake model: the samples agree token for token.
    assert reqs[0].output_token_ids == reqs[1].output_token_ids == reqs[2].output_token_ids
    checker.check_all_free()


def test_fork_copies_the_recurrent_state_and_shares_full_pages() -> None:
    s, w, checker = make("hybrid-align")
    add_family(s, list(range(1, 14)), 2)
    step(s, w, checker)
    out, _ = step(s, w, checker)
    kv = s.kv_cache_manager
    parent_ids, sib_ids = kv.get_block_ids("p"), kv.get_block_ids("p.1")
    assert sib_ids[0][:3] == parent_ids[0][:3]  # attention pages 0-2 (tokens 0-11) shared by refcount
    assert sib_ids[0][3] != parent_ids[0][3]  # token 12 starts a page: a fresh one of its own
    copies = out.prefix_page_copies["p.1"]
    assert set(copies) == {1}
    src_block, col = copies[1]
    assert col == 11 // 4 and src_block not in sib_ids[1]  # the parent's running state, copied
    drain(s, w, checker)
    checker.check_all_free()


def test_aborting_the_parent_lets_siblings_run_alone() -> None:
    s, w, checker = make("hybrid-align", budget=4)
    reqs = add_family(s, list(range(1, 14)), 3)
    step(s, w, checker)
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    drain(s, w, checker)
    assert [r.num_output_tokens for r in reqs[1:]] == [6, 6]
    checker.check_all_free()


def test_aborting_a_parked_sibling() -> None:
    s, w, checker = make("hybrid-align", budget=4)
    reqs = add_family(s, list(range(1, 14)), 3)
    step(s, w, checker)
    s.finish_requests("p.1", RequestStatus.FINISHED_ABORTED)
    assert s.get_num_unfinished_requests() == 2
    drain(s, w, checker)
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED
    assert reqs[2].num_output_tokens == 6
    checker.check_all_free()


def test_no_fork_without_a_running_parent_or_with_a_different_prompt() -> None:
    s, w, checker = make("hybrid-align")
    s.add_request(make_request("q", [5, 6, 7, 8, 9, 10], fork_of="nobody"))
    s.add_request(make_request("p", list(range(1, 14))))
    s.add_request(make_request("x", list(range(2, 15)), fork_of="p"))  # not the same prompt
    out, _ = step(s, w, checker)
    assert {r.req_id for r in out.scheduled_new_reqs} == {"q", "p", "x"}
    drain(s, w, checker)
    checker.check_all_free()


def test_a_full_prefix_hit_releases_siblings_at_once() -> None:
    """The parent's hit already reaches the fork point: siblings take the same hit, same step."""
    s, w, checker = make("hybrid-align")
    prompt = list(range(1, 14))
    s.add_request(make_request("warm", prompt[:12] + [40], max_tokens=1))
    drain(s, w, checker)
    add_family(s, prompt, 3)
    out, _ = step(s, w, checker)
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs} == {
        "p": 12,
        "p.1": 12,
        "p.2": 12,
    }
    drain(s, w, checker)
    checker.check_all_free()
