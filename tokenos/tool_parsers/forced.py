"""Parsers for forced tool choices, where a grammar already constrains the output's shape.

- `RequiredToolsParser` (tool_choice "required"): the output is a JSON array of call objects,
  ``[{"name": "f", "parameters": {...}}, ...]``, each read like a llama3_json object (json_calls). Anything
  the array does not explain is content, from the point where the structure stops holding: text after
  the closing ``]``, an element that is not an object, an object that ends without a name, the point where
  a named object broke, or a whole text that does not start with ``[``. With the grammar, content is "".
- `NamedToolParser` (tool_choice naming function f): the whole output is f's arguments object, so the
  result is one call to f with the stripped text (holding back trailing whitespace while streaming), and
  "{}" for an empty final output.

Both are monotone for the same reasons as the user parsers: decisions are made on text that no continuation
changes, and raw text only grows.
"""

from __future__ import annotations

from typing import Any

from tokenos.tool_parsers.base import ParsedCall, ParseResult, ToolParser
from tokenos.tool_parsers.json_calls import take_object_call
from tokenos.tool_parsers.json_scan import skip_ws


class RequiredToolsParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParseResult:
        pos = skip_ws(text, 0)
        if pos == len(text):
            return ParseResult("")
        if text[pos] != "[":
            return ParseResult(text.strip())
        return _parse_array(text, pos + 1, final)


def _parse_array(text: str, pos: int, final: bool) -> ParseResult:
    calls: list[ParsedCall] = []

    def done(content_from: int | None = None) -> ParseResult:
        content = "" if content_from is None else text[content_from:].strip()
        return ParseResult(content, tuple(calls))

    want_element = True  # after "[" or ","
    while True:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return done()
        char = text[pos]
        if char == "]":  # also after a trailing comma, or for an empty array
            return done(pos + 1)
        if not want_element:
            if char != ",":
                return done(pos)
            want_element = True
            pos += 1
            continue
        if char != "{":
            return done(pos)
        ended, pos = take_object_call(text, pos, final, calls)
        if ended:
            return done(pos)
        want_element = False


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, tools: list[dict[str, Any]] | None = None, *, function_name: str) -> None:
        super().__init__(tools)
        if not isinstance(function_name, str) or not function_name:
            raise ValueError(f"NamedToolParser needs a function name, got {function_name!r}")
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParseResult:
        arguments = text.strip()
        if final and not arguments:
            arguments = "{}"
        return ParseResult("", (ParsedCall(self.function_name, arguments),))
