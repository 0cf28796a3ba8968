"""POST /v1/responses on a canned engine: the request as the chat request it means (instructions,
input items, tools, text.format, max_output_tokens), the output items (message, reasoning, function
calls), the status, refused fields, and the streamed events adding up to the non-streamed response.
The official client against the real server is in test_server_responses."""

from __future__ import annotations

import json
import math

import pytest

from tests.fixtures.fakes import CannedEngine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
AUTO = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


def post(client, **body):
    return client.post("/v1/responses", json={"input": "Hi", **body})


def events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    out = []
    for block in response.text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


def test_text_response_and_its_stream(make_client):
    engine = CannedEngine("Hello there.", chunk=3, max_model_len=4096)
    client = make_client(engine)
    r = post(
        client,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
    )
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    (message,) = body["output"]
    assert message["type"] == "message" and message["content"][0] == {
        "type": "output_text",
        "text": "Hello there.",
        "annotations": [],
        "logprobs": [],
    }
    assert body["usage"]["output_tokens"] == len("Hello there.") and body["usage"]["input_tokens"] > 0
    prompt = engine.tokenizer.decode(engine.calls[0]["prompt"].token_ids)
    assert "system:Be brief.\nuser:Hi" in prompt
    stream = events(post(client, stream=True))
    kinds = [e["type"] for e in stream]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in stream] == list(
        range(len(stream))
    )
    text = "".join(e["delta"] for e in stream if e["type"] == "response.output_text.delta")
    assert text == "Hello there." == stream[-1]["response"]["output"][0]["content"][0]["text"]
    assert stream[-1]["response"]["usage"]["output_tokens"] == len("Hello there.")


def test_cut_by_max_output_tokens_is_incomplete(make_client):
    client = make_client(CannedEngine("a long answer", max_model_len=4096))
    body = post(client, max_output_tokens=3).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events(post(client, max_output_tokens=3, stream=True))[-1]["type"] == "response.incomplete"


def test_function_calls_and_their_results(make_client):
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine = CannedEngine(reply, chunk=4, max_model_len=4096)
    client = make_client(engine, **AUTO)
    body = post(client, tools=[WEATHER]).json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Oslo"} and call["call_id"]
    stream = events(post(client, tools=[WEATHER], stream=True))
    args = "".join(e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta")
    assert args == call["arguments"] and stream[-1]["response"]["output"][0]["name"] == "get_weather"
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    assert post(client, tools=[WEATHER], input=history, tool_choice="none").status_code == 200
    assert "tool:sunny" in engine.tokenizer.decode(engine.calls[-1]["prompt"].token_ids)
    forced = post(client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert forced.status_code == 200 and engine.calls[-1]["params"].structured_outputs is not None


def test_text_format_is_structured_output(make_client):
    engine = CannedEngine('{"a": 1}', max_model_len=4096)
    client = make_client(engine)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    assert post(client, text=fmt).status_code == 200
    assert engine.calls[-1]["params"].structured_outputs.json == schema


def test_reasoning_item(make_client):
    engine = CannedEngine(
        "Think.</think>Answer.", chunk=2, max_model_len=4096, reasoning_parser="deepseek_r1"
    )
    client = make_client(engine)
    body = post(client).json()
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert (
        body["output"][0]["content"][0]["text"] == "Think."
        and body["output"][1]["content"][0]["text"] == "Answer."
    )
    stream = events(post(client, stream=True))
    reasoning = "".join(e["delta"] for e in stream if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "Think."


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "grammar"}}}, "text"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": []}, "input"),
    ],
)
def test_refused(make_client, body, param):
    r = post(make_client(CannedEngine("x", max_model_len=4096)), **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_numbers_json_cannot_write_are_refused(make_client):
    """Found by the fuzz test: the response echoes `text`, `tools` and `tool_choice`, so Infinity / NaN
    (which Python's JSON reader takes) inside them would fail the answer with a 500."""
    client = make_client(CannedEngine("x", max_model_len=4096))
    for field, value in [
        ("text", {"": math.inf}),
        ("tools", [{"type": "function", "name": "f", "x": math.nan}]),
    ]:
        body = json.dumps({"input": "hi", field: value}, allow_nan=True)
        r = client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(client, metadata={"k": 1}).status_code == 400  # metadata: strings, as OpenAI's
