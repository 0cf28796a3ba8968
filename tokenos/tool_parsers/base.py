"""Tool-call parsing as one pure function of the text so far, and the stream that diffs it.

A parser is ``parse(text, final) -> ParseResult``. ``final=True`` parses a finished output; ``final=False``
parses a prefix conservatively: it reports only what no continuation can change. So for every prefix p of
a text t, ``parse(p, False) <= parse(t, True)`` (and ``<= parse(p2, False)`` for p a prefix of p2), where
``a <= b`` means: a's content is a prefix of b's, a's calls are a prefix of b's calls list, each with the
same name and with arguments a prefix of b's.

`ToolStream` turns that into OpenAI-style deltas: it re-parses the whole text on every `feed` and emits the
difference against what it already emitted; `finish` parses with ``final=True`` and emits the rest. Because
every emission extends the previous one, the concatenated deltas equal the non-streamed parse for any
chunking of the text. A parser that broke the invariant would make a later parse retract emitted text; the
stream then emits nothing for that field (and logs it once) rather than send a contradiction.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


def hold_back_partial(text: str, tag: str) -> str:
    """`text` without a trailing proper prefix of `tag`: that suffix may still turn into the tag (the
    hold-back of every conservative parse of a growing text: tool-call tags, reasoning markers)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return text[:-size]
    return text


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments (a prefix of it while streaming)


@dataclass(frozen=True)
class ParseResult:
    content: str  # the text outside tool calls, stripped of leading/trailing whitespace
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class CallDelta:
    index: int  # position of the call in the message's tool_calls
    name: str | None  # set only on the first delta of that call
    arguments: str  # the new fragment of its arguments ("" allowed on the first delta)


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolParser(ABC):
    """Turns model output text into content and tool calls; see the module docstring for the contract."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # OpenAI tool definitions; the formats parsed here are self-describing, so parsers may ignore them.
        self.tools: list[dict[str, Any]] = list(tools or [])

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParseResult:
        """The content and calls of `text`; with ``final=False`` only what no continuation can change."""


class ToolStream:
    """One streamed message: feed it the model's text deltas, get back content and tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content = ""
        self._calls: list[ParsedCall] = []
        self._finished = False
        self._warned = False

    def feed(self, delta_text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("ToolStream.feed() after finish()")
        if not delta_text:
            return StreamDelta()
        self._text += delta_text
        return self._advance(self._parser.parse(self._text, final=False))

    def finish(self) -> StreamDelta:
        if self._finished:
            raise RuntimeError("ToolStream.finish() called twice")
        self._finished = True
        return self._advance(self._parser.parse(self._text, final=True))

    @property
    def result(self) -> ParseResult:
        return ParseResult(self._content, tuple(self._calls))

    def _advance(self, parsed: ParseResult) -> StreamDelta:
        content = self._extend_content(parsed.content)
        if len(parsed.calls) < len(self._calls):
            self._retracted("calls")
        deltas = (self._extend_call(index, call) for index, call in enumerate(parsed.calls))
        return StreamDelta(content, tuple(delta for delta in deltas if delta is not None))

    def _extend_content(self, content: str) -> str:
        if not content.startswith(self._content):
            self._retracted("content")
            return ""
        fragment = content[len(self._content) :]
        self._content = content
        return fragment

    def _extend_call(self, index: int, call: ParsedCall) -> CallDelta | None:
        assert index <= len(self._calls), "calls are enumerated in order"
        if index == len(self._calls):
            self._calls.append(call)
            return CallDelta(index, call.name, call.arguments)
        sent = self._calls[index]
        if call.name != sent.name or not call.arguments.startswith(sent.arguments):
            self._retracted(f"call {index}")
            return None
        if len(call.arguments) == len(sent.arguments):
            return None
        self._calls[index] = call
        return CallDelta(index, None, call.arguments[len(sent.arguments) :])

    def _retracted(self, field: str) -> None:
        # A parser bug: the invariant says this cannot happen. Clients cannot take text back, so the stream
        # keeps what it sent and says so once per message instead of per token.
        if not self._warned:
            self._warned = True
            parser = getattr(self._parser, "name", type(self._parser).__name__)
            logger.warning("tool parser %r retracted already streamed %s", parser, field)
