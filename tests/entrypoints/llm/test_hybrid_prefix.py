"""Hybrid prefix caching beyond vLLM, end to end through `LLM` against transformers greedy:
checkpoints every C tokens independent of the attention page (a shared system prompt hits), exact
end-of-request checkpoints (a three-turn chat resumes each turn from the whole previous one), and
preemption resuming from the latest checkpoint. (The recurrent rollback API is tested in
tests/worker/test_recurrent.py.)

Hit rates are printed (run with -s): prefix_cache_hits / prefix_cache_queries, in tokens."""

from __future__ import annotations

import random

import pytest

from tests.fixtures.checkpoints import VOCAB
from tests.fixtures.llm import HYBRID, make_llm
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams

INTERVAL = 8  # tokens per recurrent checkpoint (the tiny models' attention pages are larger or equal)
# Greedy tokens identical to transformers' (recomputed without a cache), logprobs within 1e-3.
prompts_of, run, check = HYBRID.prompts, HYBRID.run, HYBRID.check

# End to end for five families, each test a few engines: the fast loop has the model-level parity
# of every family in tests/models instead.
pytestmark = pytest.mark.slow


def hit_rate(llm) -> tuple[int, int]:
    m = llm.get_metrics()
    return m["prefix_cache_hits"], m["prefix_cache_queries"]


def test_shared_system_prompt(hybrid):
    folder, ref = hybrid
    shared = prompts_of(1, 5 * INTERVAL + 3, 5 * INTERVAL + 3, seed=20)[0]
    prompts = [shared + tail for tail in prompts_of(4, 3, 12, seed=21)]
    rates = {}
    for name, kwargs in {
        "off": {},
        "on": dict(mamba_cache_mode="all", mamba_checkpoint_interval=INTERVAL),
    }.items():
        llm = make_llm(folder, **kwargs)
        outs = [run(llm, [p])[0] for p in prompts]  # one at a time: each sees the earlier ones
        check(outs, prompts, ref)
        rates[name] = hit_rate(llm)
        cached = [o.num_cached_tokens for o in outs]
        print(
            f"\n{name}: page {llm.engine.kv_cache_config.kernel_block_sizes}, cached {cached}, "
            f"hits {rates[name][0]}/{rates[name][1]} tokens"
        )
        if name == "on":
            assert cached[0] == 0
            assert all(c >= 5 * INTERVAL for c in cached[1:])
    assert rates["on"][0] >= 3 * 5 * INTERVAL > rates["off"][0]


def test_three_turn_chat(hybrid):
    folder, ref = hybrid
    llm = make_llm(folder)  # end checkpoints are on by default
    rng = random.Random(22)
    conversation: list[int] = []
    cached = []
    for turn in range(3):
        prompt = conversation + [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 15))]
        out = run(llm, [prompt])
        check(out, [prompt], ref)
        cached.append(out[0].num_cached_tokens)
        if turn:  # the whole previous turn, but its last sampled token (never fed back)
            assert cached[-1] == len(conversation) - 1
        conversation = prompt + list(out[0].outputs[0].token_ids)
    # the later turns resumed from the previous turn's exact end state
    assert llm.engine.get_stats()["prefix_cache_hits_by_source"]["end_checkpoint"] == sum(cached[1:])
    # pages per KV-cache group while a request runs (tokenos:kv_cache_group_pages): recurrent ones too
    probe = EngineCoreRequest(
        request_id="probe", prompt_token_ids=conversation, sampling_params=EngineSamplingParams(max_tokens=4)
    )
    llm.engine.add_request(probe)
    llm.engine.step()
    groups = llm.engine.get_kv_groups()
    assert "mamba" in {g["kind"] for g in groups} and all(g["pages"] > 0 for g in groups)
    # every group took pages from the cache on the hits (turns 2 and 3, then the probe); a recurrent
    # group exactly one state page per hit
    assert all(g["hit_pages"] > 0 for g in groups)
    assert {g["hit_pages"] for g in groups if g["kind"] == "mamba"} == {3}
    llm.engine.abort_requests(["probe"])
    hits, queries = hit_rate(llm)
    print(f"\nchat: cached {cached}, hits {hits}/{queries} tokens")


def test_preemption_resumes_from_checkpoint(hybrid):
    """Distinct prompts (nothing shared), a pool for one request: every hit is a preempted request
    resuming from its latest surviving checkpoint instead of recomputing from zero."""
    folder, ref = hybrid
    kwargs = dict(mamba_checkpoint_interval=INTERVAL, max_model_len=64)
    probe = make_llm(folder, **kwargs)
    groups = probe.engine.kv_cache_config.kv_cache_groups
    del probe

    def pages(num_tokens: int) -> int:
        return sum(
            -(-g.kv_cache_spec.max_memory_usage_bytes(num_tokens) // g.kv_cache_spec.page_size_bytes)
            for g in groups
        )

    # Prompts 2 tokens short of an interval boundary and a pool for two of them plus a few pages:
    # they soon need new pages at once, so some are preempted and later resume. Whether a victim's
    # checkpoint pages survive until it is readmitted depends on the exact page sizes of the
    # family, so two pool sizes are tried: every run must keep parity, one must resume from a hit.
    length = 6 * INTERVAL - 2
    prompts = prompts_of(6, length, length, seed=23)
    seen = []
    for extra in (2, 4):
        llm = make_llm(folder, num_kv_blocks=2 * pages(length) + extra, max_num_batched_tokens=32, **kwargs)
        check(run(llm, prompts), prompts, ref)
        metrics = llm.get_metrics()
        seen.append((metrics["num_preemptions"], metrics["prefix_cache_hits"]))
        del llm
    print(f"\npreemption: (preemptions, hit tokens) per pool size: {seen}")
    assert any(preemptions > 0 and hits > 0 for preemptions, hits in seen)


def test_default_settings(hybrid):
    """By default: vLLM's page-sized checkpoints, plus end-of-request checkpoints (no memory cost);
    turning the latter off gives exactly vLLM's behaviour."""
    folder, _ = hybrid
    llm = make_llm(folder)
    cfg = llm.engine.kv_cache_config
    assert len(set(cfg.kernel_block_sizes)) == 1
    fine = llm.engine.scheduler.kv_cache_manager.fine
    assert fine is not None and fine.at_end
    del llm
    assert make_llm(folder, mamba_checkpoint_at_end=False).engine.scheduler.kv_cache_manager.fine is None
