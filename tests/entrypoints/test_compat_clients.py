"""The clients vLLM users run, unchanged, against `tokenos serve` on loopback: LangChain's `ChatOpenAI`
(invoke, stream, batch, structured output, tools), lm-eval's `local-completions` on a tiny local task,
whose per-choice loglikelihoods and accuracy must equal lm-eval's `hf` run of transformers on the same
weights, and guidellm's benchmark over both OpenAI routes (in its own environment: tools/install_clients.sh).
(The `openai` client is exercised throughout test_server*.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Literal

import httpx
import pytest

from tests.fixtures import lm_eval_task
from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import REPO, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOOL_FLAGS = ("--chat-template", "chatml_tools", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(folder):
    with running_server(folder, *TOOL_FLAGS, max_model_len=1024) as server:
        yield server


def test_langchain_chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    chat = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="tiny", max_tokens=12, temperature=0, max_retries=0
    )
    answer = chat.invoke("Hello!")
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] == "length"
    assert "".join(chunk.content for chunk in chat.stream("Hello!")) == answer.content
    assert [m.content for m in chat.batch(["Hello!"] * 3)] == [answer.content] * 3

    class Flags(BaseModel):
        ready: bool
        level: int

    structured = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        model="tiny",
        max_tokens=60,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    ).with_structured_output(Flags, method="json_schema")
    assert isinstance(structured.invoke("Report."), Flags)

    def get_weather(city: Literal["Paris", "Oslo"]) -> str:  # bounded: a noise model ends the call
        """The weather in a city."""
        return "sunny"

    tools = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="tiny", max_tokens=60
    ).bind_tools([get_weather], tool_choice="any", strict=True)  # strict: no extra keys
    message = tools.invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")


def test_lm_eval_local_completions_equals_transformers(server, folder, tmp_path):
    pytest.importorskip("lm_eval")
    include = lm_eval_task.write_task(str(tmp_path))
    ours, our_scores = lm_eval_task.through_server(server.url, "tiny", folder, include)
    theirs, their_scores = lm_eval_task.through_transformers(folder, include)
    assert ours == theirs
    flat = [
        (a, b)
        for mine, ref in zip(our_scores, their_scores, strict=True)
        for a, b in zip(mine, ref, strict=True)
    ]
    assert len(flat) == 80 and max(abs(a - b) for a, b in flat) < 1e-3, json.dumps(flat[:4])


GUIDELLM = os.path.join(REPO, ".venv-clients", "bin", "guidellm")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_benchmark(server, folder, tmp_path, route):
    """guidellm's concurrent benchmark, unchanged: every request succeeds, streamed with usage in each
    chunk, the output as long as asked (it sends ignore_eos) and the prompt as long as the server's own
    tokenizer says."""
    if not os.path.exists(GUIDELLM):
        if os.environ.get("TOKENOS_REQUIRE_CLIENTS") == "1":
            pytest.fail(f"{GUIDELLM} is missing: run tools/install_clients.sh")
        pytest.skip("guidellm is not installed: run tools/install_clients.sh")
    report = tmp_path / "guidellm.json"
    command = [
        GUIDELLM, "run",
        "--backend", f"kind=openai_http,target={server.url},request_format={route}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", "kind=max_requests,count=12",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={folder}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    assert benchmark["metrics"]["request_totals"] == {
        "successful": 12,
        "errored": 0,
        "incomplete": 0,
        "total": 12,
    }
    for stats in benchmark["requests"]["successful"]:
        assert stats["output_tokens"] == 8
        body = json.loads(stats["request_args"])["body"]
        asked = {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
        count = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", **asked}).json()["count"]
        assert stats["prompt_tokens"] == count
