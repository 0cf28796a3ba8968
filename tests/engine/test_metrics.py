"""The Prometheus metrics: what the frontend and the engine-core stats put in the text exposition."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from tokenos.engine.metrics import EngineMetrics


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return samples(metrics)[key]


def finished_request(reasons: list[str], prompt_len: int, generated: int, arrival: float):
    return SimpleNamespace(
        arrival_time=arrival,
        prompt_token_ids=list(range(prompt_len)),
        num_generation_tokens=generated,
        samples=[SimpleNamespace(finish_reason=r) for r in reasons],
    )


def test_request_latencies_and_counters():
    m = EngineMetrics("tiny")
    m.record_first_token(0.05)
    m.record_token(0.01)
    m.record_token(0.02)
    m.record_finished(finished_request(["length", "stop"], prompt_len=7, generated=6, arrival=10.0), now=12.5)
    m.record_finished(finished_request(["abort"], prompt_len=3, generated=0, arrival=20.0), now=20.1)

    assert value(m, "tokenos:request_success_total", finished_reason="length") == 1
    assert value(m, "tokenos:request_success_total", finished_reason="stop") == 1
    assert value(m, "tokenos:request_success_total", finished_reason="abort") == 1
    assert value(m, "tokenos:prompt_tokens_total") == 10
    assert value(m, "tokenos:generation_tokens_total") == 6
    assert value(m, "tokenos:time_to_first_token_seconds_count") == 1
    assert value(m, "tokenos:inter_token_latency_seconds_count") == 2
    assert abs(value(m, "tokenos:inter_token_latency_seconds_sum") - 0.03) < 1e-9
    assert value(m, "tokenos:e2e_request_latency_seconds_count") == 2
    assert value(m, "tokenos:e2e_request_latency_seconds_bucket", le="0.3") == 1  # the 0.1 s one


def test_engine_stats_set_gauges_and_add_counter_increases():
    m = EngineMetrics("tiny")
    m.update_from_engine_stats(
        {
            "num_running": 3,
            "num_waiting": 2,
            "kv_cache_usage": 0.25,
            "prefix_cache_queries": 100,
            "prefix_cache_hits": 40,
            "num_preemptions": 1,
        }
    )
    m.update_from_engine_stats(
        {
            "num_running": 1,
            "num_waiting": 0,
            "kv_cache_usage": 0.5,
            "prefix_cache_queries": 150,
            "prefix_cache_hits": 40,
            "num_preemptions": 2,
        }
    )
    assert value(m, "tokenos:num_requests_running") == 1
    assert value(m, "tokenos:num_requests_waiting") == 0
    assert value(m, "tokenos:kv_cache_usage_perc") == 0.5
    assert value(m, "tokenos:prefix_cache_queries_total") == 150
    assert value(m, "tokenos:prefix_cache_hits_total") == 40
    assert value(m, "tokenos:num_preemptions_total") == 2
    # The core's counters restarted (lower than before): the new count is added, never subtracted.
    m.update_from_engine_stats({"prefix_cache_queries": 10})
    assert value(m, "tokenos:prefix_cache_queries_total") == 160


def test_two_engines_in_one_process_do_not_collide():
    a, b = EngineMetrics("tiny"), EngineMetrics("tiny")
    a.record_first_token(1.0)
    assert value(a, "tokenos:time_to_first_token_seconds_count") == 1
    assert value(b, "tokenos:time_to_first_token_seconds_count") == 0


def _sample_count(m: EngineMetrics, reason: str) -> float:
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            if sample.name == "tokenos:request_success_total" and sample.labels["finished_reason"] == reason:
                return sample.value
    return 0.0


def test_aborts_count_as_finished_with_reason_abort():
    """A request the frontend gives up on (client gone, explicit abort) is counted, once per sample."""
    from tests.fixtures.tokenizers import FakeTokenizer
    from tokenos.core.messages import EngineCoreOutput
    from tokenos.engine.input_processor import InputProcessor
    from tokenos.engine.output_processor import OutputProcessor
    from tokenos.sampling_params import RequestOutputKind, SamplingParams

    m = EngineMetrics("m")
    door = InputProcessor(FakeTokenizer(), SimpleNamespace(max_model_len=64, vocab_size=1000))
    outputs = OutputProcessor(FakeTokenizer(), m)
    request = door.process("r", "abc", SamplingParams(n=2, max_tokens=5), output_kind=RequestOutputKind.DELTA)
    outputs.add_request(request)
    first, second = request.sample_ids
    outputs.process_outputs(
        [EngineCoreOutput(first, [100]), EngineCoreOutput(second, [101], finish_reason=1)]
    )
    assert outputs.abort_request("r") == [first]  # only the unfinished sample is aborted in the core
    assert _sample_count(m, "abort") == 1 and _sample_count(m, "length") == 1
    assert outputs.abort_request("r") == []  # once
    assert _sample_count(m, "abort") == 1


def test_rejections_and_engine_death_are_visible():
    m = EngineMetrics("m")
    m.record_rejected("queue_full")
    m.record_rejected("queue_full")
    m.record_engine_death()
    text = m.render().decode()
    assert 'tokenos:request_rejected_total{model_name="m",reason="queue_full"} 2.0' in text
    assert 'tokenos:engine_dead{model_name="m"} 1.0' in text
    assert 'tokenos:engine_core_deaths_total{model_name="m"} 1.0' in text
