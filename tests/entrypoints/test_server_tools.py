"""Tool calling through the real server and the official `openai` client: `tokenos serve` with
``--enable-auto-tool-choice --tool-call-parser hermes --chat-template chatml_tools`` over a tiny
random-weight Llama (SmolLM2's tokenizer). The model is noise, so whatever calls come back are the
grammar's doing: every forced call must parse and validate against its tool's schema."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import running_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", "chatml_tools")
    with running_server(folder, *flags, "--num-kv-blocks", "600", max_model_len=1024) as server:
        yield server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def check_call(call) -> None:
    """A tool call the client parsed: a known function, arguments valid against its schema."""
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_calls_valid_tools(client):
    completion = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=64, temperature=1.0, seed=3,
        max_completion_tokens=150,
    )  # fmt: skip
    assert len(completion.choices) == 64
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            check_call(call)


def test_named_function_streamed_equals_unstreamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_completion_tokens=80
    )
    full = client.chat.completions.create(**kwargs)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and full.choices[0].finish_reason == "stop"
    check_call(call)
    names, arguments = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta_call.function.name:
                names.append(delta_call.function.name)
            arguments += delta_call.function.arguments or ""
    assert names == ["get_weather"] and arguments == call.function.arguments


def test_required_stream_accumulates_in_the_client(client):
    kwargs = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_completion_tokens=150,
    )
    full = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion()
    want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls]
    assert got == want and streamed.choices[0].finish_reason == "tool_calls"


def test_auto_and_a_tool_result_round_trip(client):
    """With auto the model may answer or call; a noise model answers text. Then the call and its result
    go back through the template."""
    auto = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_completion_tokens=20)
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for call in message.tool_calls or []:
        assert call.function.name in SCHEMAS
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_completion_tokens=5
    )
    assert reply.choices[0].message.tool_calls in (None, [])
