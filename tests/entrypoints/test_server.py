"""The real server end to end: `python -m tokenos.entrypoints.openai.api_server` on a loopback port,
a tiny random-weight Llama (SmolLM2's tokenizer, so the vocabulary is 49,152), the engine core in
its own process, and clients that are the official `openai` package and raw httpx.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.dashboards import dashboard_problems
from tests.fixtures.servers import MAX_MODEL_LEN, metric, running_server

pytest.importorskip("tokenos.engine.async_llm")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

API_KEY = "test-key"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer (tests.fixtures.checkpoints.SERVED_LLAMA)."""
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, "--api-key", API_KEY) as server:
        yield server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models_and_probes(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/version").json()["version"]
    # /tokenize and /detokenize are behind the key like every route but the probes
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).status_code == 401
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=headers()).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    body = {"tokens": tokens["tokens"]}
    text = httpx.post(f"{server.url}/detokenize", json=body, headers=headers()).json()["prompt"]
    assert "Hello world" in text


def test_greedy_completion_is_deterministic(client):
    kwargs = dict(
        model="tiny",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 8 and first.usage.prompt_tokens > 0


def test_token_id_prompts_n_and_logprobs(client):
    out = client.completions.create(
        model="tiny",
        prompt=[[100, 200, 300], [400, 500]],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.top_logprobs[0]) >= 2
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hi"}],
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    full = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hi"}],
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in content)


def test_structured_output(server, client):
    """response_format, vLLM's structured_outputs and guided_* through the real server: the random model's
    answers parse, match and stop; a grammar that cannot compile is a 400."""
    import re

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Who are you?"}],
        max_completion_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "who", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    value = json.loads(chat.choices[0].message.content)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    assert chat.choices[0].finish_reason == "stop"
    phone = client.completions.create(
        model="tiny",
        prompt="Phone:",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].text)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Pick"}],
        max_completion_tokens=10,
        stream=True,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text in ("red", "green", "blue")
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"guided_regex": "[0-9"})


def test_openai_parse_with_a_pydantic_model(server, client):
    """The official client's `chat.completions.parse(response_format=Model)`: it sends a strict
    json_schema and parses the answer into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Ticket(BaseModel):
        title: str = Field(max_length=12)
        priority: Literal["low", "high"]
        open: bool

    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "File a ticket"}],
        response_format=Ticket,
        max_completion_tokens=60,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )
    ticket = completion.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and ticket.priority in ("low", "high")


def test_bad_requests(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[100] * MAX_MODEL_LEN, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers())
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert (
        client.completions.create(model="tiny", prompt="still serving", max_tokens=1).usage.completion_tokens
        == 1
    )


def test_disconnect_aborts_the_request_in_the_engine(server, client):
    body = {"model": "tiny", "prompt": "count", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers(), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    # The engine core reports it went idle long before 200 tokens could have been generated.
    deadline = time.monotonic() + 30
    running = None
    while time.monotonic() < deadline:
        running = metric(httpx.get(f"{server.url}/metrics").text, "vllm:num_requests_running{")
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0
    assert client.completions.create(model="tiny", prompt="after", max_tokens=2).usage.completion_tokens == 2


def test_metrics(server, client):
    before = httpx.get(f"{server.url}/metrics").text
    prompt = [100 + i for i in range(37)]
    client.completions.create(model="tiny", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text

    def moved(name: str) -> float:
        return metric(text, name) - metric(before, name)

    # The served model name labels every series (vLLM's model_name), engine "0".
    length = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}'
    assert moved(length) == 1
    assert moved("vllm:prompt_tokens_total{") == 37
    assert moved("vllm:generation_tokens_total{") == 5
    assert moved("vllm:request_prompt_tokens_sum{") == 37
    assert moved("vllm:request_generation_tokens_sum{") == 5
    assert moved("vllm:inter_token_latency_seconds_count{") == 4
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert moved(f"vllm:{name}_seconds_count{{") == 1, name  # the core reported when it scheduled it
    assert moved("vllm:iteration_tokens_total_count{") >= 5  # prefill, then a step per decode
    assert moved("vllm:prefix_cache_queries_total{") >= 37
    assert metric(text, "vllm:cache_config_info{") == 1
    assert dashboard_problems(text) == []  # the shipped dashboard reads a real server


def test_engine_death_fails_requests_and_exits_nonzero(tiny_llama):
    # Room for a request that outlives the kill.
    with running_server(tiny_llama, max_model_len=8192) as server:
        body = {
            "model": "tiny",
            "prompt": "long",
            "max_tokens": 8000,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(server.engine_core_pid(), signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
        assert any("error" in e for e in events), rest[-3:]
        assert server.proc.wait(timeout=30) == 1
    assert "engine" in server.log and "died" in server.log


def test_32_concurrent_streams_match_offline_llm(server, tiny_llama):
    """32 clients stream greedy completions at once; each gets exactly what the offline LLM gives."""
    import asyncio
    import random

    from tokenos import LLM, SamplingParams

    rng = random.Random(42)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 60))] for _ in range(32)]
    max_tokens = 12

    async def stream_one(http: httpx.AsyncClient, prompt: list[int]) -> str:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = []
        async with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers()) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[len("data: ") :])
                    text.extend(c["text"] for c in chunk["choices"])
        return "".join(text)

    async def all_streams() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(stream_one(http, p) for p in prompts))

    streamed = asyncio.run(all_streams())
    llm = LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert streamed == [o.outputs[0].text for o in offline]
