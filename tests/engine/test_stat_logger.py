"""The periodic stats line: throughput over the interval, gauges, the interval's prefix-cache hit rate,
and quiet while idle."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tokenos.engine.stat_logger import StatLogger


def test_the_line_and_idle_silence(caplog):
    metrics = SimpleNamespace(total_prompt_tokens=0, total_generation_tokens=0)
    stats_logger = StatLogger(metrics, interval_s=0.0)
    stats_logger.last_time -= 2.0  # two seconds into the interval
    metrics.total_prompt_tokens, metrics.total_generation_tokens = 400, 100
    stats = dict(
        num_running=3, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=80, prefix_cache_hits=20
    )
    line = stats_logger.line({**stats, "num_preemptions": 2}, stats_logger.last_time + 2.0)
    assert line.startswith(
        "Engine 000: Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 50.0"
    )
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%" in line
    assert line.endswith("Preemptions: 2")
    idle = dict(stats, num_running=0, num_waiting=0)
    with caplog.at_level(logging.INFO, logger="tokenos.stats"):
        stats_logger.update(idle)  # one all-zero line after work...
        stats_logger.update(idle)  # ...then nothing
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenos.stats"]
    assert len(lines) == 1 and "Avg prompt throughput: 0.0" in lines[0] and "hit rate: 0.0%" in lines[0]
