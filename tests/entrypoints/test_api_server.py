"""The HTTP layer over the fake engine: responses, streaming, usage, disconnects, health, metrics.

The fake engine echoes the prompt (one character = one token), so every text is predictable.
Disconnect tests run the app under uvicorn on a loopback port and really drop the connection.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tokenos.engine.core_client import EngineDeadError
from tokenos.engine.input_processor import InputProcessor

pytestmark = pytest.mark.timeout(60)


def sse_events(text: str) -> list:
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_text_prompt(make_client, fake_engine):
    r = make_client(fake_engine).post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"] == [
        {
            "index": 0,
            "text": "hel",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    ]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 8
    call = fake_engine.calls[0]
    assert call["prompt"].token_ids == [ord(c) for c in "hello"]


def test_completion_several_prompts_and_n(make_client, fake_engine):
    r = make_client(fake_engine).post(
        "/v1/completions", json={"prompt": [[104, 105], [120, 121, 122]], "max_tokens": 2, "n": 2}
    )
    choices = r.json()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "hi"), (1, "ih"), (2, "xy"), (3, "yz")]
    assert r.json()["usage"]["completion_tokens"] == 8
    assert len({c["request_id"] for c in fake_engine.calls}) == 2


def test_completion_echo_and_logprobs(make_client, fake_engine):
    r = make_client(fake_engine).post(
        "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "abab"
    # echo with logprobs scores the prompt too (the fake engine has no prompt scores: None; the real
    # engine's are compared with transformers in test_server_logprobs)
    assert fake_engine.calls[0]["params"].prompt_logprobs == 1
    assert choice["logprobs"]["tokens"] == ["a", "b", "a", "b"]
    assert choice["logprobs"]["token_logprobs"] == [None, None, -0.5, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert choice["logprobs"]["top_logprobs"][2] == {"a": -0.5, "b": -2.0}


def test_sampling_fields_reach_the_engine(make_client, fake_engine):
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "seed": 3,
        "priority": 5,
        "cache_salt": "tenant-a",
        "user": "u1",
        "temperature": 0.0,
        "stop": ["zz"],
    }
    assert make_client(fake_engine).post("/v1/completions", json=body).status_code == 200
    call = fake_engine.calls[0]
    assert (call["priority"], call["cache_salt"]) == (5, "tenant-a")
    assert (call["params"].seed, call["params"].temperature, call["params"].stop) == (3, 0.0, ["zz"])


def test_completion_stream_with_usage(make_client, fake_engine):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    r = make_client(fake_engine).post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert len({e["id"] for e in events}) == 1


def test_chat_completion(make_client, fake_engine):
    body = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
        ],
        "max_completion_tokens": 4,
    }
    r = make_client(fake_engine).post("/v1/chat/completions", json=body)
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "syst",
        "reasoning_content": None,
        "tool_calls": [],
    }
    assert body["usage"]["prompt_tokens"] == len("system:S\nuser:U\nassistant:")


def test_chat_template_override_from_server_and_request(make_client, fake_engine):
    # The server's --chat-template reaches the engine's front door (EngineArgs.chat_template).
    fake_engine.input_processor = InputProcessor(
        fake_engine.tokenizer, fake_engine.model_config, chat_template="SERVER|"
    )
    client = make_client(fake_engine)
    messages = [{"role": "user", "content": "q"}]
    assert (
        client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3}).json()["choices"][
            0
        ]["message"]["content"]
        == "SER"
    )
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "chat_template": "REQ|"}
    )
    assert r.json()["choices"][0]["message"]["content"] == "REQ"


def test_chat_stream(make_client, fake_engine):
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3,
        "stream": True,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    events = sse_events(make_client(fake_engine).post("/v1/chat/completions", json=body).text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length"
        assert all(len(c["logprobs"]["content"]) == 1 for c in mine[1:])
    text0 = "".join(
        e["choices"][0]["delta"]["content"] or "" for e in events if e["choices"][0]["index"] == 0
    )
    assert text0 == "use"


def test_models_tokenize_detokenize_version(make_client, fake_engine):
    client = make_client(fake_engine, served_model_name="my-name")
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["my-name"] and models["data"][0]["max_model_len"] == 64
    assert client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi"}).status_code == 404
    tok = client.post("/tokenize", json={"prompt": "ab"}).json()
    assert tok == {"count": 2, "max_model_len": 64, "tokens": [97, 98]}
    chat_tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat_tok["count"] == len("user:a\nassistant:")
    assert client.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    assert client.post("/detokenize", json={"tokens": [99999]}).status_code == 400
    assert client.get("/version").json()["version"]


def test_metrics_endpoint(make_client, fake_engine):
    fake_engine.metrics.ttft.observe(0.1)
    r = make_client(fake_engine).get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="fake-model"} 1.0' in r.text


def test_dead_engine_gives_503(make_client, fake_engine):
    client = make_client(fake_engine)
    assert client.get("/health").status_code == 200
    fake_engine.dead_error = EngineDeadError("engine core process exited unexpectedly (exit code -9)")
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_engine_errors_become_openai_errors(make_client, fake_engine):
    client = make_client(fake_engine)
    fake_engine.generate_error = ValueError("Token id 5 is not allowed here.")
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Token id 5 is not allowed here."
    fake_engine.generate_error = RuntimeError("kaboom")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and "kaboom" in r.json()["error"]["message"]
    # Streaming has already sent 200: the error is an event, then [DONE].
    events = sse_events(client.post("/v1/completions", json={"prompt": "hi", "stream": True}).text)
    assert events == [
        {
            "error": {
                "message": "Internal error: RuntimeError: kaboom",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    ]


def test_openai_client_against_a_live_server(live_server, fake_engine):
    url = live_server(fake_engine, api_key="k")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    completion = client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
    assert completion.choices[0].text == "hell" and completion.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "z"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "use"
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake-model", prompt="hello", max_tokens=4, temperature=-1)


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_stream_disconnect_aborts(live_server, slow_engine):
    engine = slow_engine
    url = live_server(engine)
    body = {"prompt": "abc", "max_tokens": 10_000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    rid = engine.calls[0]["request_id"]
    assert wait_for(lambda: rid in engine.cancelled and rid in engine.aborted)


def test_non_stream_disconnect_aborts(live_server, slow_engine):
    engine = slow_engine
    url = live_server(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 10_000}, timeout=0.5)
    assert wait_for(lambda: len(engine.calls) == 1)
    rid = engine.calls[0]["request_id"]
    assert wait_for(lambda: rid in engine.cancelled and rid in engine.aborted)
    # and the server keeps serving
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_truncate_prompt_tokens_and_vllm_xargs_over_http(make_client, fake_engine):
    client = make_client(fake_engine)
    long_prompt = "x" * 100  # more than the fake model's 64 positions
    assert client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}).status_code == 400
    body = {"prompt": long_prompt, "max_tokens": 2, "truncate_prompt_tokens": 10, "vllm_xargs": {"rule": "x"}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
    call = fake_engine.calls[-1]
    assert len(call["prompt"].token_ids) == 10 and call["params"].extra_args == {"rule": "x"}
    chat = {
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 2,
        "truncate_prompt_tokens": 12,
    }
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(fake_engine.calls[-1]["prompt"].token_ids) == 12


def test_metrics_count_http_requests_as_vllm_does(make_client, fake_engine):
    client = make_client(fake_engine)
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}).status_code == 400
    assert client.get("/v1/models/fake-model").status_code == 200
    client.get("/health")
    text = client.get("/metrics").text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1.0' in text
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 1.0' in text
    # The route's template, not the id in the path (one series per route, not per model).
    assert 'http_requests_total{handler="/v1/models/{model_id:path}",method="GET",status="2xx"} 1.0' in text
    assert 'handler="/health"' not in text and 'handler="/metrics"' not in text  # probes are left out
    assert 'http_request_duration_seconds_count{handler="/v1/completions",method="POST"} 2.0' in text
    assert "http_request_duration_highr_seconds_count 3.0" in text
    assert 'http_response_size_bytes_count{handler="/v1/completions"} 2.0' in text
    assert "process_resident_memory_bytes " in text and "python_info{" in text
    assert text.count("# TYPE process_resident_memory_bytes") == 1
