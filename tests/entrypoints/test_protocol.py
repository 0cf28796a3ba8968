"""Request validation: every bad input gets the right status and an OpenAI-style error body,
and the server keeps serving. Runs the real FastAPI app over the fake engine (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.fixtures.tokenizers import FakeTokenizer
from tokenos.core.validation import InvalidRequestError
from tokenos.engine.input_processor import InputProcessor
from tokenos.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenos.sampling_params import RequestOutputKind

COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

# (route, body changes, status, param); max_model_len is 64 in the fake engine.
BAD_REQUESTS = [
    ("/v1/completions", {"model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "x" * 64}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 60, "max_tokens": 10}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 5000]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"n": 0}, 400, "n"),
    ("/v1/completions", {"temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"top_p": 0.0}, 400, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"presence_penalty": 3.0}, 400, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1000": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"temperature": "0.5"}, 400, "temperature"),
    ("/v1/completions", {"max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"n": True}, 400, "n"),
    ("/v1/completions", {"stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"stop": ["ok", ""]}, 400, "stop"),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 70}]}, 400, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 100}, 400, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"chat_template": "broken"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "nope"}, 404, "model"),
    # token ids out of range are refused before anything decodes them (echo decodes the prompt)
    ("/v1/completions", {"prompt": [5, -1], "echo": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[5], [2**40]]}, 400, "prompt"),
    # structured output that cannot work is refused by the field that asked for it
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
    ),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, 400, "response_format"),
    ("/v1/chat/completions", {"response_format": "json"}, 400, "response_format"),
    ("/v1/completions", {"guided_regex": "[0-9"}, 400, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": 5}}, 400, "guided_json"),
    ("/v1/chat/completions", {"guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, 400, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    (
        "/v1/completions",
        {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
        400,
        "guided_decoding_backend",
    ),
    (
        "/v1/completions",
        {"guided_regex": "a", "guided_whitespace_pattern": " "},
        400,
        "guided_whitespace_pattern",
    ),
    # features tokenos does not implement yet are refused by name, never silently ignored
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/completions", {"best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"logits_processors": ["x"]}, 400, "logits_processors"),
    # vLLM's allowed_token_ids / bad_words / truncate_prompt_tokens, checked like every field
    ("/v1/completions", {"allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [1, 5000]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {"bad_words": ["ok", ""]}, 400, "bad_words"),
    ("/v1/completions", {"bad_words": "word"}, 400, "bad_words"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt_logprobs": -1}, 400, "prompt_logprobs"),
]


def test_harmless_values_of_unsupported_fields_are_accepted(make_client, fake_engine):
    client = make_client(fake_engine)
    accepted = [
        ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}),
        ("/v1/completions", {"best_of": 1, "unknown_extra": 5}),
        ("/v1/completions", {"response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"guided_choice": ["a", "b"], "guided_decoding_backend": "auto"}),
        ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}),
        (
            "/v1/chat/completions",
            {"guided_json": {"type": "object"}, "structured_outputs": {"disable_any_whitespace": True}},
        ),
    ]
    for route, changes in accepted:
        body = {**(CHAT if "chat" in route else COMPLETION), **changes}
        assert client.post(route, json=body).status_code == 200


@pytest.mark.parametrize(("route", "changes", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_openai_error(make_client, fake_engine, route, changes, status, param):
    client = make_client(fake_engine)
    body = {**(CHAT if "chat" in route else COMPLETION), **changes}
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fake_engine.calls == []  # rejected before the engine saw it
    # and the server keeps serving
    assert client.post(route, json=CHAT if "chat" in route else COMPLETION).status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(make_client, fake_engine, route):
    client = make_client(fake_engine)
    r = client.post(route, content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_unknown_route_is_404_with_openai_body(make_client, fake_engine):
    r = make_client(fake_engine).get("/v1/nothing")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_api_key_guards_the_api_routes(make_client, fake_engine):
    client = make_client(fake_engine, api_key="s3cret")
    assert client.get("/v1/models").status_code == 401
    r = client.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_completion_request_maps_to_sampling_params():
    request = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "min_p": 0.1,
            "seed": 7,
            "stop": "x",
            "stop_token_ids": [3],
            "logit_bias": {"9": -100},
            "logprobs": 2,
            "ignore_eos": True,
            "min_tokens": 1,
            "repetition_penalty": 1.1,
            "include_stop_str_in_output": True,
            "stream": True,
        }
    )
    p = request.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.0, 0.5, 0, 0.1, 7)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.logprobs) == (["x"], [3], {9: -100.0}, 2)
    assert p.ignore_eos and p.include_stop_str_in_output and p.min_tokens == 1 and p.repetition_penalty == 1.1
    assert p.output_kind == RequestOutputKind.DELTA
    assert CompletionRequest(prompt="hi").to_sampling_params().output_kind == RequestOutputKind.FINAL_ONLY


def test_vllm_sampling_extras_map_to_sampling_params():
    fields = {"allowed_token_ids": [3, 4], "bad_words": ["no", "no"], "truncate_prompt_tokens": 8}
    for request in (
        CompletionRequest.model_validate({"prompt": "hi", **fields}),
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields}),
    ):
        p = request.to_sampling_params()
        assert (p.allowed_token_ids, p.bad_words, p.truncate_prompt_tokens) == ([3, 4], ["no"], 8)


def test_chat_max_tokens_default_to_the_rest_of_the_context():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert request.to_sampling_params().max_tokens is None  # no cap but the context length
    door = InputProcessor(FakeTokenizer(), SimpleNamespace(max_model_len=64, vocab_size=1000))
    door.check_context(10, None)
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    params = request.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (4, 3)
    door.check_context(60, params.max_tokens)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64") as e:
        door.check_context(61, params.max_tokens)
    assert e.value.param == "max_tokens"


def test_structured_output_fields_map_to_one_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "json",
        ),
        ({"response_format": {"type": "json_object"}}, "json"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"guided_choice": ["a", "b"]}, "choice"),
        ({"guided_grammar": 'start: "a"'}, "grammar"),
        ({"structured_outputs": {"choice": ["x"]}}, "choice"),
        ({"response_format": {"type": "text"}}, None),
    ]
    for fields, kind in cases:
        params = ChatCompletionRequest.model_validate({**CHAT, **fields}).to_sampling_params()
        if kind is None:
            assert params.structured_outputs is None
        else:
            assert params.structured_outputs.spec()[0] == kind
    compact = ChatCompletionRequest.model_validate(
        {**CHAT, "guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}}
    ).to_sampling_params()
    assert compact.structured_outputs.disable_any_whitespace
