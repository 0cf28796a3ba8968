"""Property tests: random add / step / abort / reset sequences against the core, with the fake
worker checking every read and the invariants checked after every step:
refcounts never negative, no block both free and referenced, the null block never freed,
cached hashes always naming pages whose contents match, every block back when all requests
end, and (FCFS) first admissions in arrival order with every request eventually finishing.
Preemption comes from memory pressure: pools are sized barely above one max-length request."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.scheduler_sim import LAYOUTS, make_engine, make_request, step
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import MambaSpec, cdiv
from tokenos.core.request import RequestStatus

MAX_MODEL_LEN = 40
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 40, 41], [20, 21, 22, 23, 24, 25, 26, 27]]

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(1, 49), max_size=6),
        st.integers(1, 30),  # max_tokens
        st.integers(0, 2),  # priority
        st.booleans(),  # salted
        st.integers(0, 9),  # 0: wants prompt logprobs
    ),
    st.tuples(st.just("step")),
    st.tuples(st.just("burst"), st.integers(2, 4)),  # several long requests at once: pressure
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    # n > 1: a parent and 1-3 siblings forked from it (prefix index, tail, max_tokens, siblings)
    st.tuples(
        st.just("fork"),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(1, 49), max_size=12),
        st.integers(1, 30),
        st.integers(1, 3),
    ),
    st.tuples(st.just("reset")),
)


def _min_blocks(specs) -> int:
    need = 0
    for s in specs:
        if isinstance(s, MambaSpec):
            need += {"align": 2, "none": 1, "all": cdiv(MAX_MODEL_LEN, s.block_size)}[s.cache_mode]
        else:
            need += cdiv(MAX_MODEL_LEN, s.block_size) + 1
    return need + 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    extra_blocks=st.integers(0, 6),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    ops=st.lists(op, min_size=5, max_size=60),
)
def test_random_operations_keep_the_invariants(layout, extra_blocks, budget, max_seqs, policy, ops):
    specs = LAYOUTS[layout]()
    num_blocks = _min_blocks(specs) + extra_blocks
    s, w, checker = make_engine(
        *specs,
        num_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(block_size=4),
        budget=budget,
        max_num_seqs=max_seqs,
        policy=policy,
    )
    n = 0
    siblings_added = 0  # n counts arrivals; a fork family is one arrival of several requests
    arrival_rank: dict[str, int] = {}
    first_admitted: list[str] = []
    aborted = False

    def do_step():
        out, _ = step(s, w, checker)
        for new in out.scheduled_new_reqs:
            if new.req_id not in arrival_rank or new.req_id in first_admitted:
                continue
            first_admitted.append(new.req_id)

    for o in ops:
        if o[0] == "add":
            _, p, tail, max_tokens, prio, salted, lp = o
            prompt = (PREFIXES[p] + tail)[: MAX_MODEL_LEN - 1]
            rid = f"r{n}"
            arrival_rank[rid] = n
            s.add_request(
                make_request(
                    rid,
                    prompt,
                    max_tokens=max_tokens,
                    priority=prio,
                    arrival_time=float(n),
                    cache_salt="t2" if salted else None,
                    prompt_logprobs=0 if lp == 0 else None,
                )
            )
            n += 1
        elif o[0] == "burst":
            for k in range(o[1]):
                rid = f"r{n}"
                arrival_rank[rid] = n
                prompt = PREFIXES[k % len(PREFIXES)][:5] + [n % 50, 3]
                s.add_request(
                    make_request(rid, prompt, max_tokens=30, ignore_eos=True, arrival_time=float(n))
                )
                n += 1
            do_step()
        elif o[0] == "fork":
            _, p, tail, max_tokens, siblings = o
            prompt = (PREFIXES[p] + tail)[: MAX_MODEL_LEN - 1]
            parent = f"r{n}"
            arrival_rank[parent] = n
            for k in range(siblings + 1):
                # Siblings wait for their parent, so later arrivals may be admitted before them.
                rid = parent if k == 0 else f"{parent}.{k}"
                s.add_request(
                    make_request(
                        rid,
                        prompt,
                        max_tokens=max_tokens,
                        arrival_time=float(n),
                        fork_of=None if k == 0 else parent,
                        seed=k,
                    )
                )
            n += 1
            siblings_added += siblings
        elif o[0] == "step":
            do_step()
        elif o[0] == "abort" and s.requests:
            rid = sorted(s.requests)[o[1] % len(s.requests)]
            s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted = True
            checker.check()
        elif o[0] == "reset":
            ok = s.reset_prefix_cache()
            assert ok == (s.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1)
            checker.check()
    # drain: every request must finish (no starvation, no livelock)
    for _ in range(40 * (n + siblings_added + 1)):
        if not s.has_unfinished_requests():
            break
        do_step()
    assert not s.has_unfinished_requests(), f"requests starved: {s.requests}"
    checker.check_all_free()
    if policy == "fcfs" and not aborted:
        ranks = [arrival_rank[r] for r in first_admitted]
        assert ranks == sorted(ranks), "FCFS admitted out of arrival order"
