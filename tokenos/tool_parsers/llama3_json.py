"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": "f", "parameters": {...}}`` objects, ``;``-separated.

The first non-whitespace text decides the mode, once and for all: an optional ``<|python_tag|>`` or a
``{`` means tool mode, anything else means the whole text is content. While the text is only whitespace
or a prefix of the python tag, nothing is decided and nothing reported.

In tool mode the text is a sequence of JSON objects (json_calls; "arguments" is accepted for "parameters",
the first present wins) separated by whitespace and ``;``. The first thing that is not a separator or an
object's ``{`` ends tool mode: from there on everything is content. So does an object that ends without a
name (it becomes content in place) and the point where a named object's JSON broke. A named object stays a
call with the raw arguments it has, even when broken or cut off. An object still open without a name holds
back everything from its brace on.
"""

from __future__ import annotations

import re

from tokenos.tool_parsers.base import ParsedCall, ParseResult, ToolParser
from tokenos.tool_parsers.json_calls import take_object_call
from tokenos.tool_parsers.json_scan import skip_ws
from tokenos.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = re.compile(r"[\s;]*+")


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        pos = skip_ws(text, 0)
        rest = text[pos:]
        if not final and PYTHON_TAG.startswith(rest):
            return ParseResult("")
        if rest.startswith(PYTHON_TAG):
            return _parse_objects(text, pos + len(PYTHON_TAG), final)
        if rest.startswith("{"):
            return _parse_objects(text, pos, final)
        return ParseResult(text.strip())


def _parse_objects(text: str, pos: int, final: bool) -> ParseResult:
    calls: list[ParsedCall] = []

    def done(content_from: int | None = None) -> ParseResult:
        content = "" if content_from is None else text[content_from:].strip()
        return ParseResult(content, tuple(calls))

    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos == len(text):
            return done()
        if text[pos] != "{":
            return done(pos)
        ended, pos = take_object_call(text, pos, final, calls)
        if ended:
            return done(pos)
