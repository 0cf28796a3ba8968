"""The forced-choice parsers: tool_choice "required" (a JSON array of calls) and a named function."""

from __future__ import annotations

import pytest

from tests.tool_parsers.checks import Case, cases
from tokenos.tool_parsers import NamedToolParser, ParsedCall, ParseResult, RequiredToolsParser

REQUIRED_CASES = [
    Case(
        "two calls",
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
        "",
        (("a", '{"x": 1}'), ("b", "{}")),
    ),
    Case(
        "indented, arguments first",
        '[\n  {\n    "arguments": {"s": "]}\\""},\n    "name": "a"\n  }\n]\n',
        "",
        (("a", '{"s": "]}\\""}'),),
    ),
    Case("missing parameters", '[{"name": "a"}]', "", (("a", "{}"),)),
    Case("empty array", "[]", ""),
    Case("truncated", '[{"name": "a", "parameters": {"x": 1', "", (("a", '{"x": 1'),)),
    Case("text after", '[{"name": "a", "parameters": {}}] extra', "extra", (("a", "{}"),)),
    Case("unnamed element", '[{"name": "a"}, {"x": 1}]', '{"x": 1}]', (("a", "{}"),)),
    Case("not an object", '[{"name": "a"}, 3]', "3]", (("a", "{}"),)),
    Case("missing comma", '[{"name": "a"} {"name": "b"}]', '{"name": "b"}]', (("a", "{}"),)),
    Case("not an array", "hello", "hello"),
    Case("empty", "", ""),
]

NAMED_CASES = [
    Case("object", '{"city": "Paris"}', "", (("f", '{"city": "Paris"}'),)),
    Case("whitespace", '  {"a": [1, 2]}\n', "", (("f", '{"a": [1, 2]}'),)),
    Case("truncated", '{"a": ', "", (("f", '{"a":'),)),
    Case("empty", "", "", (("f", "{}"),)),
]


@cases(REQUIRED_CASES)
def test_required(case: Case) -> None:
    assert RequiredToolsParser().parse(case.text, True) == case.expected


@cases(NAMED_CASES)
def test_named(case: Case) -> None:
    assert NamedToolParser(None, function_name="f").parse(case.text, True) == case.expected


def test_named_streams_the_name_first() -> None:
    parser = NamedToolParser([], function_name="f")
    assert parser.parse("", False) == ParseResult("", (ParsedCall("f", ""),))
    assert parser.parse(' {"a": 1 ', False) == ParseResult("", (ParsedCall("f", '{"a": 1'),))


def test_named_needs_a_name() -> None:
    with pytest.raises(ValueError, match="function name"):
        NamedToolParser(None, function_name="")
