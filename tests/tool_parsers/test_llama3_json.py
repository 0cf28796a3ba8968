"""Exact non-streamed parses of canned Llama 3.1 / 3.2 JSON tool-call outputs."""

from __future__ import annotations

from tests.tool_parsers.checks import Case, cases
from tokenos.tool_parsers import Llama3JsonToolParser, ParseResult

CASES = [
    Case(
        "single",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        (("get_weather", '{"city": "Paris"}'),),
    ),
    Case(
        "python tag, several",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}\n{"name": "c"}',
        "",
        (("a", '{"x": 1}'), ("b", "{}"), ("c", "{}")),
    ),
    Case(
        "arguments synonym",
        '  \n{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}',
        "",
        (("a", '{"x": [1, {"y": "}"}]}'),),
    ),
    Case(
        "first present wins",
        '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}',
        "",
        (("f", '{"a": 1}'),),
    ),
    Case("parameters first", '{"parameters": {"q": "x"}, "name": "search"}', "", (("search", '{"q": "x"}'),)),
    Case(
        "escapes",
        '{"name": "say", "parameters": {"text": "a \\"quoted\\" {brace} caf\\u00e9 ☕\\\\"}}',
        "",
        (("say", '{"text": "a \\"quoted\\" {brace} caf\\u00e9 ☕\\\\"}'),),
    ),
    Case("text after", '{"name": "a", "parameters": {}};\nThat is all.', "That is all.", (("a", "{}"),)),
    Case("content", 'The answer is {"name": 1}', 'The answer is {"name": 1}'),
    Case("unnamed object", '{"answer": 42} and more', '{"answer": 42} and more'),
    Case(
        "unnamed object after a call",
        '{"name": "f", "parameters": {}} {"answer": 42} tail',
        '{"answer": 42} tail',
        (("f", "{}"),),
    ),
    Case(
        "malformed",
        '{"name": "f", "parameters": {"a": 1} "b": 2}',
        '"b": 2}',
        (("f", '{"a": 1}'),),
    ),
    Case("not json", "{curly braces are fine}", "{curly braces are fine}"),
    Case("truncated", '{"name": "f", "parameters": {"a": [1, 2', "", (("f", '{"a": [1, 2'),)),
    Case("truncated name", '{"name": "f', '{"name": "f'),
    Case("python tag only", "<|python_tag|>", ""),
    Case("python tag then code", '<|python_tag|>print("hi")', 'print("hi")'),
    Case("partial python tag", "<|python", "<|python"),
    Case("empty", "", ""),
    Case("whitespace", "  \n", ""),
]


@cases(CASES)
def test_parse(case: Case) -> None:
    assert Llama3JsonToolParser().parse(case.text, True) == case.expected


def test_mode_undecided_until_the_first_character() -> None:
    parser = Llama3JsonToolParser()
    for text in ["", "  ", " <|py", "<|python_tag|"]:
        assert parser.parse(text, False) == ParseResult("")
    assert parser.parse(" <|px", False) == ParseResult("<|px")
    assert parser.parse("Hello", False) == ParseResult("Hello")
    assert parser.parse('{"name": "f", "par', False).calls[0].arguments == ""
