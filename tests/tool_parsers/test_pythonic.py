"""Exact non-streamed parses of canned pythonic (Llama 3.2 / Llama 4) tool-call outputs."""

from __future__ import annotations

from tests.tool_parsers.checks import Case, cases
from tokenos.tool_parsers import ParsedCall, ParseResult, PythonicToolParser

CASES = [
    Case(
        "two calls",
        "[get_weather(city='San Francisco', unit=\"celsius\"), get_time()]",
        "",
        (("get_weather", '{"city": "San Francisco", "unit": "celsius"}'), ("get_time", "{}")),
    ),
    Case(
        "nested values",
        "[f(a=[1, {'b': None}, (2, 3)], c=True, d=-1.5, e={'k': [False]})]",
        "",
        (("f", '{"a": [1, {"b": null}, [2, 3]], "c": true, "d": -1.5, "e": {"k": [false]}}'),),
    ),
    Case(
        "quotes and brackets in strings",
        "[f(s='it\\'s )] (', t=\"a\\\"b]\", u='café ☕')]",
        "",
        (("f", '{"s": "it\'s )] (", "t": "a\\"b]", "u": "café ☕"}'),),
    ),
    Case("dotted name", "  [tools.search(q='x')]  ", "", (("tools.search", '{"q": "x"}'),)),
    Case("multiline", "[\n  f(\n    a=1,\n  ),\n  g(b=2)\n]", "", (("f", '{"a": 1}'), ("g", '{"b": 2}'))),
    Case("text after", "[f()]\nDone.", "Done.", (("f", "{}"),)),
    Case("reference", "[1] see the reference", "[1] see the reference"),
    Case("bracketed word", "[Note] this is content", "[Note] this is content"),
    Case("sentence", "I think [x(y=1)] works", "I think [x(y=1)] works"),
    Case("positional", "[f(1)]", "[f(1)]"),
    Case("non-literal", "[f(a=b)]", "[f(a=b)]"),
    Case("star kwargs", "[f(**a)]", "[f(**a)]"),
    Case("repeated keyword", "[f(a=1, a=2)]", "[f(a=1, a=2)]"),
    Case("not json-able", "[f(a={1, 2})]", "[f(a={1, 2})]"),
    Case("invalid second", "[f(a=1), g(x)]", "g(x)]", (("f", '{"a": 1}'),)),
    Case("structure break", "[f(a=1) g()]", "g()]", (("f", '{"a": 1}'),)),
    Case("mismatched bracket", "[f(a=1), g(a=[1)]", "g(a=[1)]", (("f", '{"a": 1}'),)),
    Case("truncated", "[f(a=1), g(b='x", "g(b='x", (("f", '{"a": 1}'),)),
    Case("truncated first", "[f(a=1", "[f(a=1"),
    Case("unclosed list", "[f(a=1)", "", (("f", '{"a": 1}'),)),
    Case("undecided", "[get_wea", "[get_wea"),
    Case("empty", "", ""),
]


@cases(CASES)
def test_parse(case: Case) -> None:
    assert PythonicToolParser().parse(case.text, True) == case.expected


def test_a_call_is_reported_only_when_complete() -> None:
    parser = PythonicToolParser()
    assert parser.parse("[f(a=1), g(b=", False) == ParseResult("", (ParsedCall("f", '{"a": 1}'),))
    assert parser.parse("  [ f", False) == ParseResult("")
    assert parser.parse("  [ f x", False) == ParseResult("[ f x")
