"""Scheduler behaviour: budget, chunking, admission, preemption, priorities, aborts, stop rules."""

from __future__ import annotations

import pytest

from tests.fixtures.scheduler_sim import EOS, attn, make_engine, make_request, mamba, step
from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams, FinishReason
from tokenos.core.request import Request, RequestStatus
from tokenos.core.sched.output import ModelRunnerOutput


def make(num_blocks=64, specs=None, max_model_len=64, caching=True, **sched_kw):
    return make_engine(
        *(specs or (attn(4),)),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        cache=CacheConfig(block_size=4, enable_prefix_caching=caching),
        budget=sched_kw.pop("max_num_batched_tokens", 16),
        max_num_seqs=sched_kw.pop("max_num_seqs", SchedulerConfig.max_num_seqs),
        **sched_kw,
    )


def canned(out, tokens_by_req):
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [tokens_by_req.get(r, []) for r in ids])


def test_budget_chunked_prefill_mixes_with_decodes():
    s, w, c = make(max_num_batched_tokens=10)
    s.add_request(make_request("a", list(range(1, 4)), max_tokens=20))
    step(s, w, c)
    s.add_request(make_request("b", list(range(100, 125)), max_tokens=2))
    out, _ = step(s, w, c)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}  # decode + a prefill chunk
    out, _ = step(s, w, c)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    out, _ = step(s, w, c)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # last chunk, then b samples
    assert s.requests["b"].num_output_tokens == 1


def test_long_prefill_threshold_and_max_num_seqs():
    s, w, c = make(max_num_batched_tokens=64, long_prefill_token_threshold=5, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(10 * i + 1, 10 * i + 13))))
    out, _ = step(s, w, c)
    assert out.num_scheduled_tokens == {"r0": 5, "r1": 5}
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_no_chunking_when_disabled():
    s, w, c = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(make_request("a", list(range(1, 40)), max_tokens=30))
    s.add_request(make_request("b", list(range(100, 140)), max_tokens=2))
    out, _ = step(s, w, c)
    assert out.num_scheduled_tokens == {"a": 39}  # b does not fit whole: waits


def test_same_step_identical_prompts_share_full_blocks():
    s, w, c = make(max_num_batched_tokens=64)
    prompt = list(range(1, 15))
    s.add_request(make_request("a", prompt))
    s.add_request(make_request("b", prompt))
    out, outs = step(s, w, c)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 12
    assert new["b"].block_ids[0][:3] == new["a"].block_ids[0][:3]
    assert out.num_scheduled_tokens == {"a": 14, "b": 2}
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 12}
    assert s.make_stats()["prefix_cache_hits"] == 12


def test_different_salts_never_share():
    s, w, c = make(max_num_batched_tokens=64)
    prompt = list(range(1, 15))
    s.add_request(make_request("a", prompt, cache_salt="x"))
    s.add_request(make_request("b", prompt, cache_salt="y"))
    out, _ = step(s, w, c)
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"a": 0, "b": 0}


def test_preemption_by_recompute_and_resume_as_new_request():
    # 8 usable blocks of 4 tokens; two requests of 12 prompt tokens growing past 16 each
    s, w, c = make(num_blocks=9, max_num_batched_tokens=32)
    s.add_request(make_request("a", list(range(1, 13)), max_tokens=12, ignore_eos=True))
    s.add_request(make_request("b", list(range(20, 32)), max_tokens=12, ignore_eos=True))
    saw_preempt = False
    for _ in range(60):
        out, _ = step(s, w, c)
        if out.preempted_req_ids:
            saw_preempt = True
            assert out.preempted_req_ids == {"b"}  # FCFS: the latest arrival goes
            assert not out.scheduled_new_reqs  # no admission in a step that preempted
            assert s.waiting.peek().request_id == "b"
            assert s.requests["b"].status == RequestStatus.PREEMPTED
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and s.requests.get("b") and s.requests["b"].num_preemptions:
                assert new.output_token_ids, "a resumed request carries its outputs"
        if not s.has_unfinished_requests():
            break
    assert saw_preempt and s.make_stats()["num_preemptions"] >= 1
    c.check_all_free()


def test_priority_policy_admits_and_preempts_by_priority():
    s, w, c = make(num_blocks=9, max_num_batched_tokens=64, policy="priority")
    s.add_request(
        make_request("low", list(range(1, 13)), max_tokens=12, ignore_eos=True, priority=5, arrival_time=0)
    )
    s.add_request(
        make_request("high", list(range(20, 32)), max_tokens=12, ignore_eos=True, priority=0, arrival_time=1)
    )
    out, _ = step(s, w, c)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["high", "low"]
    preempted = set()
    while s.has_unfinished_requests():
        out, _ = step(s, w, c)
        preempted |= out.preempted_req_ids
    assert preempted == {"low"}
    c.check_all_free()


def test_abort_anywhere_returns_every_block():
    s, w, c = make(max_num_batched_tokens=8)
    for i in range(4):
        s.add_request(make_request(f"r{i}", list(range(10 * i + 1, 10 * i + 20)), max_tokens=30))
    step(s, w, c)
    step(s, w, c)
    s.finish_requests(["r0", "r3"], RequestStatus.FINISHED_ABORTED)  # running mid-prefill, waiting
    out, _ = step(s, w, c)
    assert {"r0", "r3"} <= out.finished_req_ids
    s.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    s.finish_requests("nope", RequestStatus.FINISHED_ABORTED)
    s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    assert s.get_num_unfinished_requests() == 0
    c.check_all_free()
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests("r1", RequestStatus.RUNNING)


def _run_one(req, outputs_per_step, max_model_len=64):
    s, w, c = make(max_model_len=max_model_len)
    s.add_request(req)
    outs = []
    for toks in outputs_per_step:
        out = s.schedule()
        outs += s.update_from_output(out, canned(out, {req.request_id: toks}))
        if not s.has_unfinished_requests():
            break
    return s, req, outs


def test_stop_on_eos_unless_ignored_and_not_before_min_tokens():
    _, req, outs = _run_one(make_request("a", [1, 2], max_tokens=10), [[5], [EOS], [6]])
    assert req.status == RequestStatus.FINISHED_STOPPED and outs[-1].finish_reason == FinishReason.STOP
    assert req.output_token_ids == [5, EOS] and outs[-1].stop_reason is None
    _, req, _ = _run_one(make_request("b", [1, 2], max_tokens=3, ignore_eos=True), [[EOS]] * 5)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [EOS] * 3
    _, req, _ = _run_one(make_request("c", [1, 2], max_tokens=9, min_tokens=2), [[EOS], [EOS], [7]])
    assert req.output_token_ids == [EOS, EOS] and req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_max_tokens_and_max_model_len():
    _, req, outs = _run_one(make_request("a", [1, 2], max_tokens=10, stop_token_ids=[9]), [[5], [9]])
    assert outs[-1].stop_reason == 9 and req.status == RequestStatus.FINISHED_STOPPED
    _, req, outs = _run_one(make_request("b", [1, 2], max_tokens=2), [[5], [6], [7]])
    assert req.output_token_ids == [5, 6] and outs[-1].finish_reason == FinishReason.LENGTH
    _, req, _ = _run_one(make_request("c", [1] * 10, max_tokens=100), [[5]] * 20, max_model_len=12)
    assert req.num_tokens == 12 and req.status == RequestStatus.FINISHED_LENGTH


def test_multi_token_output_truncated_at_stop():
    _, req, outs = _run_one(make_request("a", [1, 2], max_tokens=10), [[5, EOS, 7]])
    assert outs[-1].new_token_ids == [5, EOS] and req.output_token_ids == [5, EOS]


def test_logprobs_and_prompt_logprobs_converted():
    s, w, c = make(max_num_batched_tokens=64)
    s.add_request(make_request("a", list(range(1, 9)), logprobs=1, prompt_logprobs=0))
    out, outs = step(s, w, c)
    (o,) = outs
    assert o.new_logprobs == [([o.new_token_ids[0], 1], [-0.5, -1.5], 1)]
    assert len(o.prompt_logprobs) == 8 and o.prompt_logprobs[-1] is None
    assert o.prompt_logprobs[0] == ([2], [-1.0], 1)


def test_add_request_rejects_bad_prompts():
    s, _, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("a", list(range(17))))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("b", []))
    s.add_request(make_request("c", [1]))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("c", [1]))


def test_from_engine_core_request():
    params = EngineSamplingParams(max_tokens=3, stop_token_ids=[4], temperature=0.0)
    ecr = EngineCoreRequest(
        request_id="x",
        prompt_token_ids=[1, 2, 3],
        sampling_params=params,
        eos_token_id=2,
        extra_eos_token_ids=[7],
        priority=1,
        cache_salt="s",
    )
    req = Request.from_engine_core_request(ecr)
    assert req.request_id == "x" and req.sampling_params.stop_token_ids == [4]
    assert req.stop_token_ids == {4, 7}
    assert req.eos_token_id == 2 and req.cache_salt == "s" and req.priority == 1
    assert req.all_token_ids == [1, 2, 3] and req.status == RequestStatus.WAITING


def test_align_mode_chunks_end_on_block_boundaries():
    s, w, c = make(specs=(attn(4), mamba(4, "align")), max_num_batched_tokens=10)
    s.add_request(make_request("a", list(range(1, 23)), max_tokens=2))
    sizes = []
    while s.has_unfinished_requests():
        out, _ = step(s, w, c)
        sizes.append(out.num_scheduled_tokens.get("a"))
    # 22 tokens, budget 10: 8 (boundary), 8 (boundary), then 4 to the last boundary (20), 2 more
    assert sizes[:4] == [8, 8, 4, 2]
    # a second identical prompt resumes from the checkpoint at 20
    s.add_request(make_request("b", list(range(1, 23)), max_tokens=1))
    out, _ = step(s, w, c)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 20
    assert out.mamba_state_copies == {"b": {1: (4, 5)}}


def test_reset_prefix_cache_and_stats():
    s, w, c = make()
    s.add_request(make_request("a", list(range(1, 10)), max_tokens=1))
    s.add_request(make_request("long", [7, 7], max_tokens=5, ignore_eos=True))
    step(s, w, c)
    assert not s.reset_prefix_cache()  # "long" still holds blocks
    while s.has_unfinished_requests():
        step(s, w, c)
    assert s.reset_prefix_cache()
    s.add_request(make_request("b", list(range(1, 10)), max_tokens=1))
    out, _ = step(s, w, c)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    stats = s.make_stats()
    assert set(stats) >= {
        "num_running",
        "num_waiting",
        "kv_cache_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
    }


def test_a_request_the_worker_fails_leaves_no_block_of_that_step_in_the_prefix_cache():
    """The worker fails a request alone (its adapter did not load, so its rows ran as the base model):
    the blocks its step filled are unpublished, while the blocks of earlier steps stay."""
    s, w, c = make(max_num_batched_tokens=8)
    prompt = list(range(1, 18))
    s.add_request(make_request("a", prompt))
    out, _ = step(s, w, c)  # 8 tokens: two full blocks, trusted
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8}
    mo = w.execute(out)
    mo.failed["a"] = "LoRA adapter could not be loaded"
    (failure,) = s.update_from_output(out, mo)
    assert failure.error == "LoRA adapter could not be loaded" and "a" not in s.requests
    s.add_request(make_request("b", prompt))
    out, _ = step(s, w, c)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # the first step's blocks only


def test_max_loras_caps_the_adapters_running_in_order_and_nobody_starves():
    s, w, c = make(max_num_batched_tokens=64)
    s.max_loras = 1
    for rid, adapter in (("a1", "a@1"), ("b1", "b@2"), ("a2", "a@1"), ("base", None)):
        name = adapter and adapter[0]
        s.add_request(make_request(rid, list(range(1, 6)), max_tokens=3, adapter_id=adapter, lora_name=name))
    out, _ = step(s, w, c)
    assert set(out.num_scheduled_tokens) == {"a1"}  # b1 waits at the head, the rest behind it
    assert s.make_stats()["lora"] == {"max_lora": 1, "running": ["a"], "waiting": ["a", "b"]}
    admitted = []
    while s.has_unfinished_requests():
        admitted += [n.req_id for n in out.scheduled_new_reqs]
        running = {s.requests[r].adapter_id for r in out.num_scheduled_tokens if r in s.requests}
        assert len(running - {None}) <= 1
        out, _ = step(s, w, c)
    assert admitted == ["a1", "b1", "a2", "base"]
