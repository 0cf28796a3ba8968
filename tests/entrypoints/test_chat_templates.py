"""The shipped ChatML tool template on SmolLM2's real tokenizer: tools in the system turn, earlier calls
in the hermes format the `hermes` parser reads back, tool results as <tool_response> blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.fixtures.tokenizers import HAS_SMOLLM2, NO_SMOLLM2
from tokenos.engine.input_processor import InputProcessor, resolve_chat_template
from tokenos.entrypoints.openai.protocol import ChatCompletionRequest
from tokenos.entrypoints.openai.tool_choice import template_renders_tools
from tokenos.tool_parsers import get_tool_parser

pytestmark = pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    from tokenos.engine.tokenizer import load_tokenizer

    config = SimpleNamespace(max_model_len=8192, vocab_size=49152, eos_token_ids=[2])
    return InputProcessor(load_tokenizer(None), config, chat_template="chatml_tools")


def test_shipped_template_by_name_renders_tools():
    template = resolve_chat_template("chatml_tools")
    assert template_renders_tools(template)
    assert not template_renders_tools(resolve_chat_template("{{ messages }}"))


def test_a_tool_round_trip_renders_in_the_hermes_format(processor):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    request = ChatCompletionRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    text = processor.render_chat(request.template_messages(), tools=request.tool_dicts()).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    earlier = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>"
    )
    assert earlier in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # what the template shows as a call, the hermes parser reads back as that call
    assistant_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    (parsed,) = get_tool_parser("hermes")().parse(assistant_turn, True).calls
    assert parsed.name == "get_weather" and parsed.arguments == '{"city": "Paris"}'


def test_without_tools_it_is_plain_chatml(processor):
    text = processor.render_chat([{"role": "user", "content": "Hi"}]).text
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
