"""Hostile input against the real server (`tokenos serve` over a tiny Llama, engine core in its own
process): the values that used to kill the engine core are 400s and the engine keeps serving; a fuzz of
hostile bodies never gets a 5xx; under load the waiting queue is bounded (429 with Retry-After, counted),
and afterwards nothing is left running, waiting or holding a block; client disconnects count as aborts."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import Server, metric, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_NUM_SEQS, MAX_WAITING = 2, 2
REAL_FUZZ_EXAMPLES = 120
BASE = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))
    with running_server(
        folder, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)
    ) as server:
        yield server


def post(server: Server, body: dict, route: str = "/v1/completions") -> httpx.Response:
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return httpx.post(
        f"{server.url}{route}", content=data, headers={"content-type": "application/json"}, timeout=60
    )


def assert_serving(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = post(server, BASE)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 1e300},
        {"temperature": 1e39},
        {"temperature": math.inf},
        {"repetition_penalty": 1e300},
        {"repetition_penalty": math.inf},
        {"top_k": 2**63},
        {"prompt": [5, -1]},
        {"prompt": [[5], [2**64]]},
        {"seed": 2**64},
        {"priority": 2**64},
        {"stop_token_ids": [2**64]},
        {"prompt": "lone \ud800 surrogate"},
        {"logprobs": 20, "top_k": -5},
    ],
)
def test_values_that_killed_the_engine_are_400s(server, changes):
    r = post(server, {**BASE, **changes})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in changes
    assert_serving(server)


NUMBERS = st.sampled_from([0, -1, 2**31, 2**63, 2**64, 1e300, 1e39, math.inf, -math.inf, math.nan, 0.5])
VALUES = (
    NUMBERS | st.sampled_from(["", "\ud800", "x" * 3000]) | st.text(max_size=20) | st.booleans() | st.none()
)
FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "min_tokens", "repetition_penalty",
    "presence_penalty", "logit_bias", "stop", "stop_token_ids", "logprobs", "priority", "prompt", "echo",
]  # fmt: skip


@settings(max_examples=REAL_FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.dictionaries(st.sampled_from(FIELDS), VALUES | st.lists(VALUES, max_size=3), min_size=1, max_size=3)
)
def test_fuzzed_bodies_never_hurt_the_real_engine(server, changes):
    r = post(server, {**BASE, **changes})
    assert r.status_code < 500, (changes, r.status_code, r.text)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_still_serving_after_the_fuzz(server):
    assert_serving(server)


async def _stream_all(server: Server, n: int, max_tokens: int) -> list[httpx.Response]:
    body = {**BASE, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:

        async def one() -> httpx.Response:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                await r.aread()
                return r

        return await asyncio.gather(*(one() for _ in range(n)))


def test_the_waiting_queue_is_bounded_and_nothing_leaks(server):
    before = httpx.get(f"{server.url}/metrics").text
    responses = asyncio.run(_stream_all(server, 16, max_tokens=120))
    ok = [r for r in responses if r.status_code == 200]
    full = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(full) == 16
    assert len(ok) >= MAX_NUM_SEQS + MAX_WAITING and full, [r.status_code for r in responses]
    assert all(r.headers.get("retry-after") == "1" for r in full)
    assert all(json.loads(r.text)["error"]["code"] == "queue_full" for r in full)
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in ok)
    text = httpx.get(f"{server.url}/metrics").text
    key = 'tokenos:request_rejected_total{engine="0",model_name="tiny",reason="queue_full"}'
    assert metric(text, key) - metric(before, key) == len(full)
    assert metric(text, "vllm:num_requests_running{") == 0
    assert metric(text, "vllm:num_requests_waiting{") == 0
    assert metric(text, "vllm:kv_cache_usage_perc{") == 0
    assert_serving(server)


def test_client_disconnects_are_counted_as_aborts(server):
    key = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    before = metric(httpx.get(f"{server.url}/metrics").text, key)
    body = {**BASE, "max_tokens": 200, "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk arrived: the request is running; now hang up
    for _ in range(100):  # the server notices each disconnect within its poll interval
        text = httpx.get(f"{server.url}/metrics").text
        if metric(text, key) - before == 3 and metric(text, "vllm:num_requests_running{") == 0:
            break
        time.sleep(0.1)
    assert metric(text, key) - before == 3
    assert metric(text, "vllm:kv_cache_usage_perc{") == 0
