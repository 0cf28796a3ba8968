"""The official `openai` client's Responses API against the real server (tiny random Llama): text,
the event stream the client folds into its final response, and a forced function call."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import running_server

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))
    with running_server(folder, "--chat-template", "chatml_tools", max_model_len=1024) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_text_and_stream(client):
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert isinstance(response.output_text, str) and response.usage.output_tokens == 8
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=8, temperature=0) as stream:
        seen = list(stream)
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    # as OpenAI does, a response cut by max_output_tokens ends with response.incomplete
    assert seen[-1].type == "response.incomplete" and "".join(deltas) == response.output_text


def test_forced_function_call(client):
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    response = client.responses.create(
        model="tiny", input="Weather?", tools=[tool], tool_choice="required", max_output_tokens=60
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    assert response.status == "completed"
    kwargs = dict(model="tiny", input="Weather?", tools=[tool], tool_choice="required", max_output_tokens=60)
    with client.responses.stream(**kwargs, temperature=0) as stream:
        final = stream.get_final_response()  # the client folds the events into the response
    (call,) = [item for item in final.output if item.type == "function_call"][:1]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
