"""A simulated engine loop: thousands of requests with shared prefixes under memory pressure,
the fake worker checking every read, the invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from tests.fixtures.scheduler_sim import FINE_LAYOUTS, LAYOUTS, make_engine, make_request, step
from tokenos.config import CacheConfig
from tokenos.core.request import RequestStatus


def run_sim(
    layout, num_requests, num_blocks, seed, policy="fcfs", abort_every=0, check_every=1, budget=32, chat=False
):
    rng = random.Random(seed)
    s, w, checker = make_engine(
        *LAYOUTS[layout](),
        num_blocks=num_blocks,
        max_model_len=64,
        cache=CacheConfig(block_size=4, mamba_checkpoint_at_end=layout in FINE_LAYOUTS),
        budget=budget,
        policy=policy,
    )
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    pending = []
    for i in range(num_requests):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 10))]
        pending.append(
            make_request(
                f"r{i}",
                prompt[:40],
                max_tokens=rng.randrange(1, 16),
                priority=rng.randrange(3),
                arrival_time=float(i),
                cache_salt=None if rng.random() < 0.8 else "tenant-b",
            )
        )
    made = {r.request_id: r for r in pending}
    done: list = []
    admitted_order = []
    seen = set()
    finished = 0
    steps = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                req = pending.pop(0)
                if chat and done and rng.random() < 0.5:
                    # A later turn: a finished request's whole conversation plus new text.
                    turn = rng.choice(done).all_token_ids + [rng.randrange(1, 50) for _ in range(3)]
                    req = make_request(
                        req.request_id,
                        turn[:60],
                        max_tokens=rng.randrange(1, 8),
                        arrival_time=req.arrival_time,
                    )
                    made[req.request_id] = req
                s.add_request(req)
        if abort_every and steps % abort_every == 0 and s.requests:
            victim = rng.choice(sorted(s.requests))
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        out, outs = step(s, w, checker, full_check=steps % check_every == 0)
        for new in out.scheduled_new_reqs:
            if new.req_id not in seen:
                seen.add(new.req_id)
                admitted_order.append(int(new.req_id[1:]))
        finished += sum(o.finished for o in outs)
        done.extend(made[o.request_id] for o in outs if o.finished)
        steps += 1
        assert steps < 50 * num_requests, "the simulation does not make progress"
    checker.check()
    checker.check_all_free()
    return s, admitted_order, finished


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sim_layouts_under_pressure(layout):
    s, order, finished = run_sim(layout, num_requests=150, num_blocks=40, seed=1)
    assert finished == 150
    stats = s.make_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    if layout != "hybrid-none":
        assert stats["prefix_cache_hits"] > 0
    assert sorted(order) == order, "FCFS admitted a later request before an earlier one"


def test_sim_thousands_of_requests_with_aborts():
    s, _, finished = run_sim("full", num_requests=2000, num_blocks=48, seed=7, abort_every=5, check_every=25)
    assert s.make_stats()["prefix_cache_hits"] > 0
    assert s.num_preemptions > 0


def test_sim_priority_policy_hybrid():
    s, _, finished = run_sim("hybrid-align", num_requests=300, num_blocks=30, seed=3, policy="priority")
    assert finished == 300


@pytest.mark.parametrize("layout", sorted(FINE_LAYOUTS))
def test_sim_fine_grained_chat(layout):
    """Multi-turn prompts (an earlier request's conversation plus new text) with exact-end checkpoints
    and sub-page hits: every copy-on-write page and resumed state is checked by the fake worker."""
    s, _, finished = run_sim(layout, num_requests=200, num_blocks=60, seed=11, chat=True, abort_every=9)
    assert s.make_stats()["prefix_cache_hits"] > 0
