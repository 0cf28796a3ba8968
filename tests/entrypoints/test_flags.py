"""The flag table: every engine setting has exactly one flag, the README's table is the generated one,
vLLM's spellings and sizes parse, vLLM-only flags are accepted with a warning or refused with the reason,
and the server flags do what vLLM's do (names, CORS, root path, response role, token ids, usage
details, request logs, GET /v1/models/{id}). (--root-path and --ssl-* go to uvicorn as they are.)"""

from __future__ import annotations

import argparse
import logging
import os
import re

import pytest

from tests.fixtures.fakes import FakeEngine
from tokenos.engine.args import EngineArgs
from tokenos.engine.flags import ENGINE_FLAGS, VLLM_FLAGS, human_int, markdown_table, memory_bytes
from tokenos.entrypoints.openai.cli_args import SERVER_FLAGS, parse_serve_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_engine_field_has_one_flag_and_every_flag_a_field():
    dests = [flag.dest for flag in ENGINE_FLAGS]
    assert sorted(dests) == sorted(EngineArgs.field_names())
    names = [name for flag in (*ENGINE_FLAGS, *SERVER_FLAGS, *VLLM_FLAGS) for name in flag.names]
    assert len(names) == len(set(names)), "a flag name is defined twice"


def test_readme_table_is_the_generated_one():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    table = re.search(r"<!-- flags:begin -->\n(.*?)<!-- flags:end -->", readme, re.S).group(1)
    assert table == markdown_table(SERVER_FLAGS), (
        "run: python -m tokenos.entrypoints.openai.cli_args --markdown"
    )


def test_vllm_sizes():
    assert [human_int(v) for v in ("2k", "2K", "25.6k", "1m", "4096")] == [2000, 2048, 25600, 10**6, 4096]
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("2.5K")
    assert memory_bytes("4GiB") == 4 * 2**30 and memory_bytes("512MiB") == 512 * 2**20
    assert (
        memory_bytes("8G") == 8 * 2**30 and memory_bytes("1000") == 1000 and memory_bytes("2gb") == 2 * 10**9
    )
    with pytest.raises(argparse.ArgumentTypeError):
        memory_bytes("lots")


def test_vllm_spellings_and_flags(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenos.flags"):
        args = parse_serve_args(
            [
                "model-dir",
                "--max_model_len=2k",
                "--served-model-name",
                "a",
                "b",
                "--kv-cache-memory",
                "1GiB",
                "--gpu-memory-utilization",
                "0.9",
                "--enforce-eager",
                "-tp",
                "1",
                "--num-gpu-blocks-override",
                "64",
            ]
        )
    assert args.model == "model-dir" and args.max_model_len == 2000 and args.served_model_name == ["a", "b"]
    assert args.kv_cache_memory_bytes == 2**30 and args.num_kv_blocks == 64
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "--gpu-memory-utilization" in warned and "--enforce-eager" in warned
    for refused in (["-tp", "2"], ["--revision", "main"]):
        with pytest.raises(SystemExit, match="is refused"):
            parse_serve_args(refused)
    assert parse_serve_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    int8 = parse_serve_args(["--kv-cache-dtype", "int8", "--calculate-kv-scales"])
    assert int8.kv_cache_dtype == "int8" and int8.calculate_kv_scales is True
    with pytest.raises(SystemExit):
        parse_serve_args(["--kv-cache-dtype", "fp16x"])  # not a choice: argparse names the choices
    assert parse_serve_args(["-q", "int4"]).quantization == "int4"
    with pytest.raises(SystemExit):
        parse_serve_args(["--quantization", "fp8"])  # not built: argparse names the choices
    with pytest.raises(SystemExit):
        parse_serve_args(["--ssl-keyfile", "k.pem"])


def test_vllm_cpu_kv_cache_space(monkeypatch):
    monkeypatch.delenv("TOKENOS_KV_CACHE_MEMORY_BYTES", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert EngineArgs().resolved_kv_cache_memory_bytes == 2 * 2**30
    assert EngineArgs(kv_cache_memory_bytes=5).resolved_kv_cache_memory_bytes == 5


def test_served_names_and_model_routes(make_client):
    client = make_client(FakeEngine(), served_model_name=["first", "second"])
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]
    assert client.get("/v1/models/second").json()["id"] == "second"
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"model": "second", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "second"
    path = make_client(FakeEngine(), model="models/llama-3")  # as given, as vLLM names it
    assert path.get("/v1/models/models/llama-3").json()["id"] == "models/llama-3"


def test_cors_preflight_is_answered_before_the_key(make_client):
    client = make_client(FakeEngine(), api_key="k", allowed_origins=["https://app.example"])
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    r = client.options("/v1/chat/completions", headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert (
        client.options("/v1/models", headers={**headers, "Origin": "https://evil.example"}).status_code == 400
    )


def test_response_role_token_ids_usage_details_and_request_logs(make_client, caplog):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
    plain = make_client(FakeEngine())
    body = plain.post("/v1/chat/completions", json=chat).json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"].get("prompt_tokens_details") is None  # vLLM: only with the flag
    client = make_client(
        FakeEngine(),
        response_role="bot",
        return_tokens_as_token_ids=True,
        enable_prompt_tokens_details=True,
        enable_log_requests=True,
    )
    with caplog.at_level(logging.INFO, logger="tokenos.server"):
        body = client.post("/v1/chat/completions", json=chat).json()
    assert body["choices"][0]["message"]["role"] == "bot"
    assert all(t["token"].startswith("token_id:") for t in body["choices"][0]["logprobs"]["content"])
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    events = [
        line
        for line in client.post("/v1/chat/completions", json=streamed).text.splitlines()
        if '"usage"' in line
    ]
    assert '"prompt_tokens_details":{"cached_tokens":2}' in events[-1]
    assert any("Received request chatcmpl-" in r.getMessage() for r in caplog.records)
