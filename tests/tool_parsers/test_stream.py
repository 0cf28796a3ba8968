"""ToolStream's own behaviour: deltas, truthiness, misuse, and surviving a parser that retracts."""

from __future__ import annotations

import pytest

from tokenos.tool_parsers import (
    CallDelta,
    HermesToolParser,
    ParsedCall,
    ParseResult,
    StreamDelta,
    ToolParser,
    ToolStream,
)


def test_deltas() -> None:
    stream = ToolStream(HermesToolParser())
    assert stream.feed("Let me ") == StreamDelta("Let me")
    assert stream.feed("<tool_c") == StreamDelta()
    assert stream.feed('all>{"name": "f", "argu') == StreamDelta("", (CallDelta(0, "f", ""),))
    assert stream.feed('ments": {"a": 1}}') == StreamDelta("", (CallDelta(0, None, '{"a": 1}'),))
    assert not stream.feed("</tool_call>")
    assert stream.finish() == StreamDelta()
    assert stream.result == ParseResult("Let me", (ParsedCall("f", '{"a": 1}'),))


def test_missing_arguments_arrive_at_the_end() -> None:
    stream = ToolStream(HermesToolParser())
    assert stream.feed('<tool_call>{"name": "f"') == StreamDelta("", (CallDelta(0, "f", ""),))
    assert stream.finish() == StreamDelta("", (CallDelta(0, None, "{}"),))


def test_misuse() -> None:
    stream = ToolStream(HermesToolParser())
    assert stream.feed("") == StreamDelta()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")
    with pytest.raises(RuntimeError):
        stream.finish()


class Retracting(ToolParser):
    """A deliberately broken parser: every parse contradicts the previous one."""

    name = "retracting"

    def __init__(self) -> None:
        super().__init__()
        self.results = iter(
            [
                ParseResult("abc", (ParsedCall("f", '{"a"'), ParsedCall("g", ""))),
                ParseResult("xy", (ParsedCall("h", '{"a"'),)),
                ParseResult("abcd", (ParsedCall("f", "{}"),)),
                ParseResult("abcde", (ParsedCall("f", '{"a": 1}'), ParsedCall("g", "[]"))),
            ]
        )

    def parse(self, text: str, final: bool) -> ParseResult:
        return next(self.results)


def test_a_retraction_emits_nothing_for_that_field(caplog: pytest.LogCaptureFixture) -> None:
    stream = ToolStream(Retracting())
    stream.feed("1")
    assert stream.feed("2") == StreamDelta()
    assert stream.feed("3") == StreamDelta("d")
    assert stream.finish() == StreamDelta("e", (CallDelta(0, None, ": 1}"), CallDelta(1, None, "[]")))
    assert stream.result == ParseResult("abcde", (ParsedCall("f", '{"a": 1}'), ParsedCall("g", "[]")))
    assert len([r for r in caplog.records if "retracted" in r.message]) == 1
