"""The clients vLLM users run, unchanged, against `tokenos serve` on loopback: LangChain's `ChatOpenAI`
(invoke, stream, batch, structured output, tools) and lm-eval's `local-completions` on a tiny local task,
whose per-choice loglikelihoods and accuracy must equal lm-eval's `hf` run of transformers on the same
weights. (The `openai` client is exercised throughout test_server*.py.)"""

from __future__ import annotations

import json
from typing import Literal

import pytest

from tests.fixtures import lm_eval_task
from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOOL_FLAGS = ("--chat-template", "chatml_tools", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(folder):
    server = Server(folder, *TOOL_FLAGS, max_model_len=1024)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


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
