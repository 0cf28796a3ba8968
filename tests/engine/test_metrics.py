"""The Prometheus metrics: vLLM V1's names, types, labels and buckets, and the values the frontend and the
engine core's stats put behind them (counters move by exactly what happened, each sample's intervals are
its timeline's, aborts and engine failures are counted)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.metrics import EngineRun, value
from tests.fixtures.scheduler_sim import attn, make_engine, make_request, step
from tokenos.config import CacheConfig
from tokenos.core.messages import FinishReason
from tokenos.engine.args import EngineArgs
from tokenos.engine.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineMetrics,
    build_1_2_5_buckets,
    cache_config_info,
)

# vLLM V1's series (vllm/v1/metrics/loggers.py) that tokenos exports: name -> Prometheus type.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:gpu_prefix_cache_queries": "counter",
    "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}
TOKENOS_SERIES = {
    "tokenos:request_rejected": "counter",
    "tokenos:engine_dead": "gauge",
    "tokenos:engine_core_deaths": "counter",
}


def families(m: EngineMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def label_values(family, label: str) -> set[str]:
    return {s.labels[label] for s in family.samples}


def buckets(m: EngineMetrics, name: str) -> list[float]:
    family = families(m)[name]
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")][:-1]  # not +Inf


def test_every_series_has_vllms_name_type_labels_and_buckets():
    m = EngineMetrics("tiny", max_model_len=1000)
    found = families(m)
    assert {name: found[name].type for name in {**VLLM_SERIES, **TOKENOS_SERIES}} == {
        **VLLM_SERIES,
        **TOKENOS_SERIES,
    }
    assert all(n.startswith(("vllm:", "tokenos:")) for n in found)  # nothing else, nothing unprefixed
    for family in found.values():
        for s in family.samples:
            assert s.labels["model_name"] == "tiny" and s.labels["engine"] == "0", s
    assert label_values(found["vllm:request_success"], "finished_reason") == {
        "stop",
        "length",
        "abort",
        "error",
    }
    assert label_values(found["vllm:prompt_tokens_by_source"], "source") == {
        "local_compute",
        "local_cache_hit",
        "external_kv_transfer",
    }
    assert label_values(found["vllm:num_requests_waiting_by_reason"], "reason") == {"capacity", "deferred"}
    assert buckets(m, "vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert TTFT_BUCKETS[-3:] == (160.0, 640.0, 2560.0)
    assert buckets(m, "vllm:inter_token_latency_seconds") == list(ITL_BUCKETS) == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ]  # fmt: skip
    assert buckets(m, "vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert buckets(m, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert buckets(m, "vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert buckets(m, "vllm:iteration_tokens_total")[:3] == [1, 8, 16]


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]


def test_n_requests_move_every_counter_by_n(monkeypatch):
    m = EngineMetrics("tiny", max_model_len=256)
    run = EngineRun(m).use_clock(monkeypatch)
    shapes = [("abcde", 3, 0), ("abcdefghij", 1, 4), ("ab" * 30, 6, 32)]  # prompt, generated, cached
    for i, (prompt, generated, cached) in enumerate(shapes):
        run.run(f"r{i}", prompt, generated, cached=cached)
    prompts = [len(p) for p, _, _ in shapes]
    generated = [g for _, g, _ in shapes]
    cached = sum(c for _, _, c in shapes)

    assert value(m, "vllm:request_success_total", finished_reason="length") == 3
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(m, "vllm:prompt_tokens_total") == sum(prompts) == 75
    assert value(m, "vllm:prompt_tokens_cached_total") == cached
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == sum(prompts) - cached
    assert value(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert value(m, "vllm:generation_tokens_total") == sum(generated)
    # The per-request histograms observed each request's own lengths.
    assert value(m, "vllm:request_prompt_tokens_count") == 3
    assert value(m, "vllm:request_prompt_tokens_sum") == sum(prompts)
    assert value(m, "vllm:request_prompt_tokens_bucket", le="5.0") == 1  # the 5-token prompt
    assert value(m, "vllm:request_prompt_tokens_bucket", le="10.0") == 2
    assert value(m, "vllm:request_prompt_tokens_bucket", le="50.0") == 2  # 60 tokens is above 50
    assert value(m, "vllm:request_generation_tokens_sum") == sum(generated)
    assert value(m, "vllm:request_generation_tokens_bucket", le="1.0") == 1
    assert value(m, "vllm:request_prefill_kv_computed_tokens_sum") == sum(prompts) - cached
    assert value(m, "vllm:request_params_max_tokens_sum") == sum(generated)
    assert value(m, "vllm:request_params_n_count") == 3 and value(m, "vllm:request_params_n_sum") == 3
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == sum(generated)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert value(m, f"vllm:{name}_seconds_count") == 3, name
    assert value(m, "vllm:inter_token_latency_seconds_count") == sum(g - 1 for g in generated)
    assert value(m, "vllm:time_per_output_token_seconds_count") == sum(g - 1 for g in generated)
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 3
    assert value(m, "vllm:iteration_tokens_total_count") == 3
    assert value(m, "vllm:iteration_tokens_total_sum") == sum(prompts)
    assert not m._first_scheduled  # nothing kept for finished samples


def test_one_samples_timeline_gives_its_intervals(monkeypatch):
    m = EngineMetrics("tiny")
    run = EngineRun(m).use_clock(monkeypatch)
    run.clock.now = 10.0
    (sid,) = run.add("r", "abcdefgh", max_tokens=3).sample_ids
    run.stats(step_tokens=8, first_scheduled={sid: 10.5})  # queued 0.5 s
    run.clock.now = 11.0
    run.output(sid, [100], num_cached_tokens=4)  # prefill 0.5 s, TTFT 1 s
    run.clock.now = 11.2
    run.output(sid, [101])
    run.clock.now = 11.6
    run.output(sid, [102], FinishReason.STOP)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1

    def sum_of(name: str) -> float:
        assert value(m, f"vllm:{name}_count") == 1
        return value(m, f"vllm:{name}_sum")

    assert sum_of("time_to_first_token_seconds") == pytest.approx(1.0)
    assert sum_of("request_queue_time_seconds") == pytest.approx(0.5)
    assert sum_of("request_prefill_time_seconds") == pytest.approx(0.5)
    assert sum_of("request_decode_time_seconds") == pytest.approx(0.6)
    assert sum_of("request_inference_time_seconds") == pytest.approx(1.1)
    assert sum_of("e2e_request_latency_seconds") == pytest.approx(1.6)
    assert sum_of("request_time_per_output_token_seconds") == pytest.approx(0.3)  # 0.6 s over 2 tokens
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.2") == 1  # 0.2, then 0.4
    assert sum_of("request_prefill_kv_computed_tokens") == 4  # 8 prompt tokens, 4 of them cached
    assert value(m, "vllm:prompt_tokens_cached_total") == 4


def test_n_samples_are_requests_each_and_the_parent_is_observed_once(monkeypatch):
    m = EngineMetrics("tiny")
    run = EngineRun(m).use_clock(monkeypatch)
    first, second = run.add("r", "abcd", n=2, max_tokens=3).sample_ids
    run.clock.now += 1
    run.output(first, [100])
    run.output(second, [101], num_cached_tokens=3)  # the sibling forks from the first sample's pages
    run.clock.now += 1
    run.output(first, [102], FinishReason.STOP)
    run.output(second, [103])
    run.clock.now += 1
    run.output(second, [104], FinishReason.LENGTH)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:prompt_tokens_total") == 8 and value(m, "vllm:prompt_tokens_cached_total") == 3
    assert value(m, "vllm:time_to_first_token_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_count") == 3  # per sample: 1 + 2, never across samples
    assert value(m, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(2 + 3)
    assert value(m, "vllm:request_params_n_count") == 1 and value(m, "vllm:request_params_n_sum") == 2
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 3
    # Not scheduled according to the core's stats: the intervals that need it are left out, not made up.
    assert value(m, "vllm:request_queue_time_seconds_count") == 0
    assert value(m, "vllm:request_prefill_time_seconds_count") == 0
    assert value(m, "vllm:request_decode_time_seconds_count") == 2


def test_aborts_count_once_per_unfinished_sample(monkeypatch):
    """A request the frontend gives up on (client gone, explicit abort) is counted, once per sample, as
    vLLM's finished_reason="abort"."""
    m = EngineMetrics("tiny")
    run = EngineRun(m).use_clock(monkeypatch)
    first, second = run.add("r", "abc", n=2, max_tokens=5).sample_ids
    run.stats(first_scheduled={first: run.clock.now, second: run.clock.now})
    run.output(first, [100])
    run.output(second, [101], FinishReason.LENGTH)
    assert run.outputs.abort_request("r") == [first]  # only the unfinished sample is aborted in the core
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert run.outputs.abort_request("r") == []  # once
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:request_params_n_count") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 2
    # Aborted while waiting: counted, its e2e observed, no interval it never reached.
    run.add("q", "xyz")
    run.outputs.abort_request("q")
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(m, "vllm:request_queue_time_seconds_count") == 2
    assert value(m, "vllm:time_to_first_token_seconds_count") == 2
    assert value(m, "vllm:prompt_tokens_total") == 6  # its prompt was never computed
    assert not m._first_scheduled


def test_a_sample_the_engine_failed_is_finished_reason_error():
    m = EngineMetrics("tiny")
    run = EngineRun(m)
    (sid,) = run.add("r", "abc").sample_ids
    run.output(sid, [], FinishReason.ABORT, error="sampling failed: boom")
    assert value(m, "vllm:request_success_total", finished_reason="error") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 0


def test_a_stop_string_is_finished_reason_stop():
    m = EngineMetrics("tiny")
    run = EngineRun(m)
    (sid,) = run.add("r", "abc", stop=["e"]).sample_ids
    assert run.output(sid, [ord("d")]) == []
    assert run.output(sid, [ord("e")]) == [sid]  # found here: the frontend aborts it in the core
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:generation_tokens_total") == 2


def test_engine_stats_set_gauges_add_counter_increases_and_read_each_step_once():
    m = EngineMetrics("tiny")
    base = {
        "kv_cache_usage": 0.25,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "num_preemptions": 1,
    }
    m.update_from_engine_stats({**base, "num_running": 3, "num_waiting": 5, "num_waiting_deferred": 2})
    m.update_from_engine_stats(
        {
            "num_running": 1,
            "num_waiting": 0,
            "kv_cache_usage": 0.5,
            "prefix_cache_queries": 150,
            "prefix_cache_hits": 40,
            "num_preemptions": 2,
            "num_steps": 7,
            "step_tokens": 33,
        }
    )
    assert value(m, "vllm:num_requests_running") == 1
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == value(m, "vllm:gpu_cache_usage_perc") == 0.5
    assert (
        value(m, "vllm:prefix_cache_queries_total") == value(m, "vllm:gpu_prefix_cache_queries_total") == 150
    )
    assert value(m, "vllm:prefix_cache_hits_total") == value(m, "vllm:gpu_prefix_cache_hits_total") == 40
    assert value(m, "vllm:num_preemptions_total") == 2
    # The core's counters restarted (lower than before): the new count is added, never subtracted.
    m.update_from_engine_stats({"prefix_cache_queries": 10})
    assert value(m, "vllm:prefix_cache_queries_total") == 160
    # An idle core re-sends its last step's stats: that step is observed once.
    m.update_from_engine_stats({"num_steps": 7, "step_tokens": 33})
    assert value(m, "vllm:iteration_tokens_total_count") == 1
    assert value(m, "vllm:iteration_tokens_total_sum") == 33


def test_waiting_by_reason_splits_parked_forks_from_capacity():
    m = EngineMetrics("tiny")
    m.update_from_engine_stats({"num_running": 1, "num_waiting": 5, "num_waiting_deferred": 2})
    assert value(m, "vllm:num_requests_waiting") == 5
    assert value(m, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert value(m, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2


def test_first_scheduling_is_kept_only_for_samples_in_flight():
    """The core may report a request the frontend already aborted (the abort crossed the stats): nothing
    about it may stay behind."""
    m = EngineMetrics("tiny")
    run = EngineRun(m)
    (sid,) = run.add("r", "abc").sample_ids
    run.outputs.abort_request("r")
    run.stats(first_scheduled={sid: 1.0, "never-seen": 2.0})
    assert m._first_scheduled == {}


def test_the_scheduler_reports_steps_and_first_admissions_once():
    s, w, c = make_engine(attn(4), cache=CacheConfig(block_size=4), budget=8)
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=3))  # 10 tokens: two chunks
    assert s.make_stats()["num_steps"] == 0
    step(s, w, c)
    stats = s.make_stats()
    assert stats["num_steps"] == 1 and stats["step_tokens"] == 8
    assert list(stats["first_scheduled"]) == ["a"]
    s.add_request(make_request("b", [20, 21], max_tokens=1))
    step(s, w, c)  # a's last chunk (2) and b's prompt (2)
    stats = s.make_stats()
    assert stats["num_steps"] == 2 and stats["step_tokens"] == 4
    assert list(stats["first_scheduled"]) == ["b"]  # a was admitted before: not again
    assert stats["num_waiting_deferred"] == 0


def test_configure_sizes_token_buckets_adds_cache_info_and_keeps_the_served_name():
    m = EngineMetrics(["served-a", "alias"])  # several served names: the first labels the series
    m.configure(100, {"block_size": "16", "num_gpu_blocks": "64"})
    assert buckets(m, "vllm:request_generation_tokens") == [1, 2, 5, 10, 20, 50, 100]
    info = families(m)["vllm:cache_config_info"].samples
    assert [(s.labels, s.value) for s in info] == [
        ({"block_size": "16", "engine": "0", "num_gpu_blocks": "64"}, 1)
    ]
    assert value(m, "vllm:num_requests_running", model_name="served-a") == 0
    info = cache_config_info(EngineArgs(block_size=32, num_kv_blocks=80), {"num_kv_blocks": 80})
    assert info["block_size"] == "32" and info["num_gpu_blocks"] == "80"
    assert info["enable_prefix_caching"] == "True" and info["num_gpu_blocks_override"] == "80"


def test_two_engines_in_one_process_do_not_collide():
    a, b = EngineMetrics("tiny"), EngineMetrics("tiny")
    a.generation_tokens.inc(3)
    assert value(a, "vllm:generation_tokens_total") == 3
    assert value(b, "vllm:generation_tokens_total") == 0


def test_rejections_and_engine_death_are_visible():
    m = EngineMetrics("m")
    m.record_rejected("queue_full")
    m.record_rejected("queue_full")
    m.record_engine_death()
    text = m.render().decode()
    assert 'tokenos:request_rejected_total{engine="0",model_name="m",reason="queue_full"} 2.0' in text
    assert 'tokenos:engine_dead{engine="0",model_name="m"} 1.0' in text
    assert 'tokenos:engine_core_deaths_total{engine="0",model_name="m"} 1.0' in text


def test_tokenos_hit_sources_and_group_pages():
    """tokenos's own series: hit tokens by source (the core's cumulative counts become increases) and
    the per-group pages read at scrape time."""
    from tokenos.engine.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    metrics.update_from_engine_stats({"prefix_cache_hits_by_source": {"block": 32, "end_checkpoint": 7}})
    metrics.update_from_engine_stats({"prefix_cache_hits_by_source": {"block": 48, "end_checkpoint": 7}})
    for hit_pages in (1, 4):  # cumulative in the core: the counter adds what grew between scrapes
        metrics.update_kv_groups(
            [
                {"group": 0, "kind": "full_attention", "pages": 5, "hit_pages": 6 * hit_pages},
                {"group": 1, "kind": "mamba", "pages": 2, "hit_pages": hit_pages},
            ]
        )
    text = metrics.render().decode()
    assert value(text, "tokenos:prefix_cache_hit_pages_total", model_name="m", group="1", kind="mamba") == 4
    assert (
        value(text, "tokenos:prefix_cache_hit_pages_total", model_name="m", group="0", kind="full_attention")
        == 24
    )
    assert 'source="block"} 48.0' in text
    assert 'source="end_checkpoint"} 7.0' in text and 'source="checkpoint"} 0.0' in text
    assert 'tokenos:kv_cache_group_pages{engine="0",group="1",kind="mamba",model_name="m"} 2.0' in text
    assert 'group="0",kind="full_attention",model_name="m"} 5.0' in text
