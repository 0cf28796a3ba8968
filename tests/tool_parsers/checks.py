"""The streaming contract as assertions, shared by every parser's tests.

`assert_le(a, b)`: a is "<=" b (content a prefix, calls a prefix of the list, same names, arguments
prefixes). `assert_prefixes_monotone` checks it along every prefix of a text. `assert_stream` feeds chunks
into a ToolStream and checks the deltas add up to the final parse; it also checks the chain of parses the
stream made directly, because the stream itself hides a retraction instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenos.tool_parsers import ParsedCall, ParseResult, ToolParser, ToolStream


@dataclass(frozen=True)
class Case:
    """A canned model output and its exact non-streamed parse."""

    id: str
    text: str
    content: str
    calls: tuple[tuple[str, str], ...] = ()

    @property
    def expected(self) -> ParseResult:
        return ParseResult(self.content, tuple(ParsedCall(*call) for call in self.calls))


def cases(items: list[Case]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("case", items, ids=[case.id for case in items])


def assert_le(a: ParseResult, b: ParseResult) -> None:
    assert b.content.startswith(a.content), (a, b)
    assert len(a.calls) <= len(b.calls), (a, b)
    for early, late in zip(a.calls, b.calls, strict=False):
        assert early.name == late.name, (a, b)
        assert late.arguments.startswith(early.arguments), (a, b)


def assert_prefixes_monotone(parser: ToolParser, text: str) -> None:
    final = parser.parse(text, True)
    previous = parser.parse("", False)
    for end in range(len(text) + 1):
        current = parser.parse(text[:end], False)
        assert_le(previous, current)
        assert_le(current, final)
        previous = current
    assert_le(parser.parse(text, False), final)


def split(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at the given positions (taken modulo len + 1, duplicates ignored)."""
    points = sorted({cut % (len(text) + 1) for cut in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


class _Recording(ToolParser):
    """Delegates to a parser and keeps every result, so the stream's own parses can be checked."""

    name = "recording"

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self.parser = parser
        self.results: list[ParseResult] = []

    def parse(self, text: str, final: bool) -> ParseResult:
        self.results.append(self.parser.parse(text, final))
        return self.results[-1]


def assert_stream(parser: ToolParser, chunks: list[str]) -> ParseResult:
    """Feed `chunks`, finish, and check the deltas against the final parse, which it returns."""
    recording = _Recording(parser)
    stream = ToolStream(recording)
    deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    final = recording.results[-1]
    assert final == parser.parse("".join(chunks), True)

    # The stream hides a retraction rather than fail, so check the parses it made directly.
    for early, late in zip(recording.results, recording.results[1:], strict=False):
        assert_le(early, late)

    content = "".join(delta.content for delta in deltas)
    names: list[str] = []
    arguments: list[str] = []
    for call in (call for delta in deltas for call in delta.calls):
        if call.index == len(names):
            assert call.name is not None, "the first delta of a call names it"
            names.append(call.name)
            arguments.append(call.arguments)
        else:
            assert call.index < len(names), "calls start in index order"
            assert call.name is None, "only the first delta of a call names it"
            assert call.arguments, "a later delta carries a fragment"
            arguments[call.index] += call.arguments
    assert content == final.content
    assert tuple(ParsedCall(*pair) for pair in zip(names, arguments, strict=True)) == final.calls
    assert stream.result == final
    return final
