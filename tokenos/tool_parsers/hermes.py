"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The text is content with zero or more call regions. A region starts at ``<tool_call>``; after optional
whitespace comes one JSON object, read by json_calls (so a tag inside a JSON string is just string text).
The region ends at the first ``</tool_call>`` (consumed) or ``<tool_call>`` (the next region, a forgotten
closing tag) after the object closed or broke; text in between is dropped as part of the region.

- A region whose object yields a name is a call, and stays one whatever follows; its arguments are the raw
  text the object has (json_calls). An unclosed region at the end of a final text is still that call.
- A region that ends, or reaches the end of a final text, without a name is content, tags included, in
  place. Until a region has a name or has ended, nothing at or after it is reported.
- Content is the text outside regions, in order, stripped. A non-final text holds back a trailing partial
  ``<tool_call>`` (it may become a tag); stripping after that keeps every report a prefix of the final one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenos.tool_parsers.base import ParsedCall, ParseResult, ToolParser, hold_back_partial
from tokenos.tool_parsers.json_calls import read_object_call
from tokenos.tool_parsers.json_scan import skip_ws
from tokenos.tool_parsers.registry import register_tool_parser

START = "<tool_call>"
END = "</tool_call>"
_BOUNDARY = re.compile(re.escape(END) + "|" + re.escape(START))


@dataclass(frozen=True)
class _Region:
    call: ParsedCall | None
    end: int | None  # one past the region; None while it may still grow


def _read_region(text: str, body: int, final: bool) -> _Region:
    """The region whose opening tag ends at `body`."""
    pos = skip_ws(text, body)
    if pos == len(text):
        return _Region(None, pos if final else None)
    call = None
    if text[pos] == "{":
        obj = read_object_call(text, pos, final)
        call = ParsedCall(obj.name, obj.arguments) if obj.name is not None else None
        if obj.resume is None:
            return _Region(call, None)
        pos = obj.resume
    boundary = _BOUNDARY.search(text, pos)
    if boundary is None:
        return _Region(call, len(text) if final else None)
    return _Region(call, boundary.end() if boundary.group() == END else boundary.start())


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            content.append(text[pos:start])
            region = _read_region(text, start + len(START), final)
            if region.call is not None:
                calls.append(region.call)
            if region.end is None:
                return ParseResult("".join(content).strip(), tuple(calls))
            if region.call is None:
                content.append(text[start : region.end])
            pos = region.end
        tail = text[pos:]
        content.append(tail if final else hold_back_partial(tail, START))
        return ParseResult("".join(content).strip(), tuple(calls))
