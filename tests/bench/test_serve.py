"""`tokenos bench serve` (tokenos/bench/serve.py): datasets, arrival process, statistics, and one run
against a live server over the fake engine."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from tests.fixtures.fakes import FakeEngine
from tokenos.bench import serve as bench
from tokenos.bench.serve import RequestResult


@pytest.mark.parametrize("p", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(p):
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert bench.percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert bench.percentile([], p) == 0.0
    assert bench.percentile([4.0], p) == 4.0


def test_summarize():
    results = [
        RequestResult(True, prompt_tokens=10, output_tokens=5, ttft_s=0.1, latency_s=0.5, itl_s=[0.1] * 4),
        RequestResult(True, prompt_tokens=20, output_tokens=3, ttft_s=0.3, latency_s=0.7, itl_s=[0.2, 0.2]),
        RequestResult(True, prompt_tokens=5, output_tokens=1, ttft_s=0.2, latency_s=0.2),
        RequestResult(False, prompt_tokens=7, error="HTTP 500: boom"),
    ]
    s = bench.summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (3, 1, "HTTP 500: boom")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 9)
    assert (
        s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 22
    )
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    # TPOT excludes the first token and requests with a single token: (0.4/4, 0.4/2)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert s["p99_e2el_ms"] == pytest.approx(np.percentile([500, 700, 200], 99))
    table = bench.format_table(s)
    assert "Output token throughput (tok/s)" in table and "P99 ITL (ms)" in table


def test_random_dataset_is_deterministic_and_in_range():
    a = bench.random_dataset(20, input_len=50, output_len=10, range_ratio=0.5, seed=1)
    assert a == bench.random_dataset(20, input_len=50, output_len=10, range_ratio=0.5, seed=1)
    assert all(25 <= len(r.prompt_token_ids) <= 75 and 5 <= r.max_tokens <= 15 for r in a)
    lo, hi = bench.TOKEN_ID_RANGE
    assert all(lo <= t < hi for r in a for t in r.prompt_token_ids)
    fixed = bench.random_dataset(3, input_len=8, output_len=4)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in fixed] == [(8, 4)] * 3


def test_prefix_repetition_dataset_shares_prefixes():
    requests = bench.prefix_repetition_dataset(12, prefix_len=16, suffix_len=4, num_prefixes=3, output_len=2)
    assert len(requests) == 12 and all(len(r.prompt_token_ids) == 20 for r in requests)
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in requests}
    assert len(prefixes) == 3
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 12


def test_workload_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt_token_ids": [101, 102], "max_tokens": 3}\n\n{"prompt_token_ids": [103], "max_tokens": 1}\n'
    )
    assert [(r.prompt_token_ids, r.max_tokens) for r in bench.load_workload(str(path))] == [
        ([101, 102], 3),
        ([103], 1),
    ]
    assert len(bench.load_workload(str(path), num_prompts=1)) == 1


def test_poisson_arrivals_average_the_rate(monkeypatch):
    """The generator's waits, with its sleep stubbed (a wait counts only once it is really awaited)."""
    requests = bench.random_dataset(40, 1, 1)
    waits: list[tuple[int, float]] = []  # (requests yielded so far, delay) per awaited sleep
    yielded: list = []

    async def sleep(delay: float) -> None:
        waits.append((len(yielded), delay))

    monkeypatch.setattr(bench, "asyncio", SimpleNamespace(sleep=sleep))

    async def collect(reqs, rate, seed):
        async for request in bench.arrivals(reqs, rate=rate, seed=seed):
            yielded.append(request)

    def arrivals(reqs, rate, seed=0) -> tuple[list, list[float], list[int]]:
        """(what it yielded, the delays it waited for, how many it had yielded at each wait)"""
        waits.clear()
        yielded.clear()
        asyncio.run(collect(reqs, rate, seed))
        return list(yielded), [d for _, d in waits], [n for n, _ in waits]

    got, delays, after = arrivals(requests, rate=400.0, seed=3)
    assert got == requests  # every request, in order
    assert after == list(range(1, 40))  # one wait between consecutive requests, none after the last
    # 39 exponential gaps of mean 2.5 ms: together well under a second, over 50 ms.
    assert all(d > 0 for d in delays) and 0.05 < sum(delays) < 1.0
    assert arrivals(requests, rate=400.0, seed=3)[1] == delays  # reproducible for a seed
    assert arrivals(requests, rate=400.0, seed=4)[1] != delays

    # The gaps are exponential with mean 1 / rate: over 4000 of them, the mean, the coefficient of
    # variation (1 for an exponential) and the empirical CDF at 0.5, 1, 2 and 3 means.
    rate = 50.0
    _, gaps, _ = arrivals(list(range(4001)), rate=rate, seed=7)
    assert len(gaps) == 4000
    mean = statistics.fmean(gaps)
    assert abs(mean * rate - 1) < 0.05
    assert abs(statistics.pstdev(gaps) / mean - 1) < 0.05
    for x in (0.5, 1.0, 2.0, 3.0):
        cdf = sum(g < x / rate for g in gaps) / len(gaps)
        assert abs(cdf - (1 - math.exp(-x))) < 0.03, (x, cdf)

    # An infinite rate never waits.
    got, delays, _ = arrivals(requests, rate=math.inf)
    assert got == requests and delays == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False])
def test_bench_against_a_live_server(live_server, capsys, stream):
    engine = FakeEngine(max_model_len=4096, vocab_size=49152)
    url = live_server(engine, api_key="k")
    argv = [
        "--base-url",
        url,
        "--api-key",
        "k",
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--max-concurrency",
        "3",
        "--request-rate",
        "1000",
    ]
    assert bench.main(argv + ([] if stream else ["--no-stream"])) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["completed"], summary["failed"], summary["model"]) == (6, 0, "fake-model")
    assert summary["total_input_tokens"] == 48 and summary["total_output_tokens"] == 30
    assert summary["mean_ttft_ms"] > 0 and summary["p99_e2el_ms"] >= summary["p50_e2el_ms"]
    if stream:
        assert summary["mean_itl_ms"] > 0
    assert all(call["params"].ignore_eos and call["params"].temperature == 0.0 for call in engine.calls)
