"""Llama 3.2 / Llama 4 pythonic tool calls: the output is a Python list of calls,
``[get_weather(city='San Francisco', unit="celsius"), get_time()]``.

Tool mode is committed once the text matches ``\\s*\\[\\s*NAME\\s*\\(`` (NAME a dotted identifier); while it
may still match nothing is reported, and once it cannot the whole text is content.

In tool mode each call is reported only when complete (its ``)`` at depth 0, skipping quoted strings and
tracking ``([{`` nesting), name and arguments at once: the arguments are
``json.dumps({keyword: ast.literal_eval(value)})``. A call with positional arguments, ``**kwargs``, a
repeated keyword or a value that is not a JSON-able literal is invalid. From an invalid call, a call still
open at the end of a final text, or any break in the list structure (something other than ``,``, ``]`` or
whitespace between calls), the rest of the text is content; calls before it stay calls. When no call was
reported yet, the whole text (its ``[`` included) is content instead. Text after the closing ``]`` is
content. Every decision is made on complete text, so reports only grow.
"""

from __future__ import annotations

import ast
import json
import re

from tokenos.tool_parsers.base import ParsedCall, ParseResult, ToolParser
from tokenos.tool_parsers.json_scan import bracket_span, skip_ws
from tokenos.tool_parsers.registry import register_tool_parser

_COMMITTED = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")
_UNDECIDED = re.compile(r"\s*(?:\[\s*(?:[A-Za-z_][\w.]*\s*)?)?")
_HEAD = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_PARTIAL_HEAD = re.compile(r"(?:[A-Za-z_][\w.]*\s*)?")
_FILLER = re.compile(r"[^'\"()\[\]{}]*+")
_STRINGS = {
    "'": re.compile(r"'[^'\\]*+(?:\\.[^'\\]*+)*+'", re.DOTALL),
    '"': re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL),
}
_CLOSER = {"(": ")", "[": "]", "{": "}"}
_BROKEN = -1


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        committed = _COMMITTED.match(text)
        if committed is None:
            if not final and _UNDECIDED.fullmatch(text):
                return ParseResult("")
            return ParseResult(text.strip())
        return _parse_list(text, text.index("[") + 1, final)


def _parse_list(text: str, pos: int, final: bool) -> ParseResult:
    calls: list[ParsedCall] = []

    def done(content_from: int | None = None) -> ParseResult:
        content = "" if content_from is None else text[content_from:].strip()
        return ParseResult(content, tuple(calls))

    def broken(at: int) -> ParseResult:
        return done(at if calls else 0)

    while True:
        pos = skip_ws(text, pos)
        if pos == len(text):
            return done()
        if text[pos] == "]":  # after a trailing comma
            return done(pos + 1)
        head = _HEAD.match(text, pos)
        if head is None:
            return done() if not final and _PARTIAL_HEAD.fullmatch(text, pos) else broken(pos)
        end = _call_end(text, head.end() - 1)
        if end is None:
            return broken(pos) if final else done()
        call = _parse_call(text[pos:end]) if end != _BROKEN else None
        if call is None:
            return broken(pos)
        calls.append(call)
        pos = skip_ws(text, end)
        if pos == len(text):
            return done()
        if text[pos] == "]":
            return done(pos + 1)
        if text[pos] != ",":
            return broken(pos)
        pos += 1


def _call_end(text: str, paren: int) -> int | None:
    """One past the ``)`` matching the ``(`` at `paren`; None while open, _BROKEN on a mismatched bracket."""
    end, broken_at = bracket_span(text, paren + 1, ")", _FILLER, _STRINGS, _CLOSER)
    return _BROKEN if broken_at is not None else end


def _parse_call(source: str) -> ParsedCall | None:
    """The call `source` (``name(kw=literal, ...)``) as a ParsedCall, or None when it is not a valid one."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted_name(node.func)
    keywords = [keyword.arg for keyword in node.keywords]
    if name is None or None in keywords or len(set(keywords)) != len(keywords):
        return None
    try:
        values = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        arguments = json.dumps(values, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    return ParsedCall(name, arguments)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None
