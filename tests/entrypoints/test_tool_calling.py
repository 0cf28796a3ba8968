"""Tool calling and reasoning over HTTP, on a canned engine (`CannedEngine`: every sample answers a
fixed text, one character per token): what reaches the template, how the answer is read into
content / reasoning_content / tool_calls, the finish reason, and that streamed deltas add up to the
non-streamed message for every chunking. The real model and server are in test_server_tools."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.fakes import CannedEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_REPLY = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
AUTO = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat(client, reply_engine=None, **body):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 400, **body}
    return client.post("/v1/chat/completions", json=body)


def schema_of(call: dict) -> dict:
    """The JSON schema a generate call was constrained by."""
    so = call["params"].structured_outputs
    assert so is not None and so.disable_any_whitespace
    return so.json if isinstance(so.json, dict) else json.loads(so.json)


def stream_message(response) -> dict:
    """The message a streamed response adds up to, as the openai client accumulates it."""
    assert response.status_code == 200, response.text
    content, reasoning, calls, finish = "", "", {}, None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] not in calls:
                    assert call["id"] and call["type"] == "function" and call["function"]["name"]
                    calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                else:
                    assert call.get("id") is None and call["function"].get("name") is None
                calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return dict(
        content=content or None,
        reasoning=reasoning or None,
        calls=[calls[i] for i in sorted(calls)],
        finish=finish,
    )


def full_message(response) -> dict:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    return dict(
        content=message["content"],
        reasoning=message.get("reasoning_content"),
        calls=calls,
        finish=choice["finish_reason"],
    )


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_auto_hermes_calls_streamed_or_not(make_client, chunk):
    engine = CannedEngine(HERMES_REPLY, chunk=chunk, max_model_len=4096)
    client = make_client(engine, **AUTO)
    full = full_message(chat(client, tools=[WEATHER, TIME]))
    assert full["content"] == "Let me look."
    assert [c["name"] for c in full["calls"]] == ["get_weather", "get_time"]
    assert json.loads(full["calls"][0]["arguments"]) == {"city": "Paris"}
    assert full["finish"] == "tool_calls"
    assert "tools:get_weather,get_time" in engine.tokenizer.decode(engine.calls[0]["prompt"].token_ids)
    assert stream_message(chat(client, tools=[WEATHER, TIME], stream=True)) == full


def test_parallel_tool_calls_false_keeps_the_first(make_client):
    client = make_client(CannedEngine(HERMES_REPLY, chunk=2, max_model_len=4096), **AUTO)
    full = full_message(chat(client, tools=[WEATHER, TIME], parallel_tool_calls=False))
    assert [c["name"] for c in full["calls"]] == ["get_weather"]
    streamed = stream_message(chat(client, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=True))
    assert streamed == full


def test_plain_answer_with_tools_is_content(make_client):
    client = make_client(CannedEngine("It is sunny.", max_model_len=4096), **AUTO)
    full = full_message(chat(client, tools=[WEATHER]))
    assert full == dict(content="It is sunny.", reasoning=None, calls=[], finish="stop")


def test_tool_choice_none_is_never_parsed(make_client):
    engine = CannedEngine(HERMES_REPLY, max_model_len=4096)
    client = make_client(engine, **AUTO)
    full = full_message(chat(client, tools=[WEATHER, TIME], tool_choice="none"))
    assert full["content"] == HERMES_REPLY and full["calls"] == [] and full["finish"] == "stop"
    # the tools still reach the template (OpenAI's "none": the model sees them, does not call them)
    assert "tools:get_weather" in engine.tokenizer.decode(engine.calls[0]["prompt"].token_ids)


def test_required_is_a_grammar_and_its_array_is_read(make_client):
    reply = '[{"name":"get_weather","parameters":{"city":"Rome"}},{"name":"get_time","parameters":{}}]'
    engine = CannedEngine(reply, chunk=4, max_model_len=4096)
    client = make_client(engine)  # forced choices need no tool parser
    full = full_message(chat(client, tools=[WEATHER, TIME], tool_choice="required"))
    assert [(c["name"], json.loads(c["arguments"])) for c in full["calls"]] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert full["content"] is None and full["finish"] == "tool_calls"
    schema = schema_of(engine.calls[0])
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert stream_message(chat(client, tools=[WEATHER, TIME], tool_choice="required", stream=True)) == full
    chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert schema_of(engine.calls[-1])["maxItems"] == 1


def test_named_function_is_forced_and_finishes_with_stop(make_client):
    engine = CannedEngine('{"city":"Oslo"}', chunk=3, max_model_len=4096)
    client = make_client(engine)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = full_message(chat(client, tools=[WEATHER, TIME], tool_choice=named))
    assert full["calls"] == [{"name": "get_weather", "arguments": '{"city":"Oslo"}'}]
    assert full["finish"] == "stop"  # as OpenAI answers a forced function
    assert schema_of(engine.calls[0]) == WEATHER["function"]["parameters"]
    assert stream_message(chat(client, tools=[WEATHER, TIME], tool_choice=named, stream=True)) == full


@pytest.mark.parametrize(
    ("server", "body", "param", "says"),
    [
        ({}, {"tools": [WEATHER]}, "tools", "--enable-auto-tool-choice"),
        ({}, {"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        (AUTO, {"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            AUTO,
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among",
        ),
        (AUTO, {"tools": [WEATHER, WEATHER]}, "tools", "repeated"),
        (AUTO, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
        (
            AUTO,
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
        (
            AUTO,
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
            "do not compile",
        ),
        (AUTO, {"functions": [{"name": "f"}]}, "functions", "use tools"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(make_client, server, body, param, says):
    client = make_client(CannedEngine("x", max_model_len=4096), **server)
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and says in error["message"], error


def test_a_template_without_tools_is_refused_unless_tool_choice_is_none(make_client):
    engine = CannedEngine("ok", max_model_len=4096)
    engine.tokenizer.chat_template = "{{ messages }}"  # a template that never reads tools
    client = make_client(engine, **AUTO)
    r = chat(client, tools=[WEATHER])
    assert r.status_code == 400 and "chatml_tools" in r.json()["error"]["message"]
    assert chat(client, tools=[WEATHER], tool_choice="none").status_code == 200


def test_tool_results_reach_the_template(make_client):
    engine = CannedEngine("ok", max_model_len=4096)
    client = make_client(engine, **AUTO)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert chat(client, tools=[WEATHER], messages=messages).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[0]["prompt"].token_ids)
    assert "assistant:\n" in prompt and "tool:sunny" in prompt


# ------------------------------------------------------------------ reasoning


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_reasoning_content_streamed_or_not(make_client, chunk):
    engine = CannedEngine(
        "Two plus two.\n</think>\n\nIt is 4.", chunk=chunk, max_model_len=4096, reasoning_parser="deepseek_r1"
    )
    client = make_client(engine)
    full = full_message(chat(client))
    assert full == dict(content="It is 4.", reasoning="Two plus two.\n", calls=[], finish="stop")
    assert stream_message(chat(client, stream=True)) == full
    dropped = full_message(chat(client, include_reasoning=False))
    assert dropped["reasoning"] is None and dropped["content"] == "It is 4."


def test_reasoning_then_tool_calls(make_client):
    reply = (
        "<think>I need the weather.</think>\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    )
    engine = CannedEngine(reply, chunk=3, max_model_len=4096, reasoning_parser="qwen3")
    client = make_client(engine, **AUTO)
    full = full_message(chat(client, tools=[WEATHER]))
    assert full["reasoning"] == "I need the weather." and full["content"] is None
    assert full["calls"] == [{"name": "get_weather", "arguments": '{"city": "Lima"}'}]
    assert full["finish"] == "tool_calls"
    assert stream_message(chat(client, tools=[WEATHER], stream=True)) == full


def test_qwen3_without_thinking_and_template_kwargs(make_client):
    engine = CannedEngine("Just the answer.", max_model_len=4096, reasoning_parser="qwen3")
    client = make_client(engine)
    full = full_message(chat(client, chat_template_kwargs={"enable_thinking": False}))
    assert full["content"] == "Just the answer." and full["reasoning"] is None
    assert "enable_thinking=False" in engine.tokenizer.decode(engine.calls[0]["prompt"].token_ids)


def test_continue_final_message_reaches_the_template(make_client):
    engine = CannedEngine("three", max_model_len=4096)
    client = make_client(engine)
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert "continue_final_message=True" in engine.tokenizer.decode(engine.calls[-1]["prompt"].token_ids)
    r = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
