"""Exact non-streamed parses of canned Hermes / Qwen outputs (the streaming contract: test_streaming)."""

from __future__ import annotations

from tests.tool_parsers.checks import Case, cases
from tokenos.tool_parsers import HermesToolParser, ParseResult

WEATHER = '{"city": "Paris"}'

CASES = [
    Case(
        "single",
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "I will check.",
        (("get_weather", WEATHER),),
    ),
    Case(
        "several",
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2.5e3, {"y": null}], "t": true}}\n</tool_call>',
        "",
        (("a", "{}"), ("b", '{"x": [1, 2.5e3, {"y": null}], "t": true}')),
    ),
    Case(
        "text around",
        'Before <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>\nmiddle\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call> after.',
        "Before \nmiddle\n after.",
        (("a", '{"k": 1}'), ("b", "{}")),
    ),
    Case(
        "escapes",
        '<tool_call>{"name": "run", "arguments": {"code": "print(\\"}{\\")", "path": "C:\\\\x\\\\", '
        '"u": "caf\\u00e9 ☕"}}</tool_call>',
        "",
        (("run", '{"code": "print(\\"}{\\")", "path": "C:\\\\x\\\\", "u": "caf\\u00e9 ☕"}'),),
    ),
    Case(
        "tags inside strings",
        '<tool_call>{"name": "html", "arguments": {"s": "</tool_call><tool_call>"}}</tool_call>',
        "",
        (("html", '{"s": "</tool_call><tool_call>"}'),),
    ),
    Case("escaped name", '<tool_call>{"name": "caf\\u00e9"}</tool_call>', "", (("café", "{}"),)),
    Case(
        "arguments first",
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        "",
        (("f", '{"a": 1}'),),
    ),
    Case(
        "first key wins",
        '<tool_call>{"name": "f", "arguments": {"a": 1}, "name": "g", "arguments": 2}</tool_call>',
        "",
        (("f", '{"a": 1}'),),
    ),
    Case(
        "parameters synonym",
        '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
        "",
        (("f", '{"a": 1}'),),
    ),
    Case("missing arguments", 'Ping. <tool_call>{"name": "ping"}</tool_call>', "Ping.", (("ping", "{}"),)),
    Case(
        "string arguments",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        (("f", '"{\\"a\\": 1}"'),),
    ),
    Case(
        "missing closing brace",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>\nok',
        "ok",
        (("f", '{"a": 1}'),),
    ),
    Case(
        "broken arguments",
        '<tool_call>{"name": "f", "arguments": {"a": <x>}}</tool_call> then',
        "then",
        (("f", '{"a":'),),
    ),
    Case(
        "extra brace",
        '<tool_call>{"name": "f", "arguments": {}}}\n</tool_call>done',
        "done",
        (("f", "{}"),),
    ),
    Case(
        "not json",
        "Sure <tool_call>get_weather(city='Paris')</tool_call> ok",
        "Sure <tool_call>get_weather(city='Paris')</tool_call> ok",
    ),
    Case(
        "unnamed object",
        'A <tool_call>{"function": "f"}</tool_call> B <tool_call>{"name": "g"}</tool_call>',
        'A <tool_call>{"function": "f"}</tool_call> B',
        (("g", "{}"),),
    ),
    Case(
        "forgotten closing tag",
        '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        "",
        (("a", "{}"), ("b", "{}")),
    ),
    Case(
        "truncated arguments",
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "tok  ',
        "Let me look.",
        (("search", '{"q": "tok'),),
    ),
    Case("truncated after name", '<tool_call>{"name": "f", ', "", (("f", "{}"),)),
    Case("truncated name", 'Hi <tool_call>\n{"name": "sea', 'Hi <tool_call>\n{"name": "sea'),
    Case("truncated tag", "Hi <tool_ca", "Hi <tool_ca"),
    Case("unclosed region", '<tool_call>{"name": "f", "arguments": {"a": 1}}\nbye', "", (("f", '{"a": 1}'),)),
    Case(
        "mentions tags",
        "Use <tool> or <tool_calls> or </tool_call> or <tool_call freely.",
        "Use <tool> or <tool_calls> or </tool_call> or <tool_call freely.",
    ),
    Case("empty", "", ""),
    Case("whitespace", " \n\t", ""),
]


@cases(CASES)
def test_parse(case: Case) -> None:
    assert HermesToolParser().parse(case.text, True) == case.expected


def test_partial_tag_is_held_back_while_streaming() -> None:
    parser = HermesToolParser()
    assert parser.parse("Hi <tool_c", False) == ParseResult("Hi")
    assert parser.parse("Hi <tool_cx", False) == ParseResult("Hi <tool_cx")
    assert parser.parse("Hi <tool_call>", False) == ParseResult("Hi")


def test_nothing_after_an_unnamed_region_until_it_ends() -> None:
    parser = HermesToolParser()
    text = 'A <tool_call>{"arguments": {"x": 1}, "na'
    assert parser.parse(text, False) == ParseResult("A")
    assert parser.parse(text + 'me": "f"', False).calls[0].arguments == '{"x": 1}'


def test_streamed_arguments_grow_without_trailing_whitespace() -> None:
    parser = HermesToolParser()
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"a": [1, \n', False).calls[0].arguments == (
        '{"a": [1,'
    )
