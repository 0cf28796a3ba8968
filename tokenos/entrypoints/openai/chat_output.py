"""One chat choice's text, read as OpenAI fields: reasoning_content, content and tool_calls.

The reasoning parser (``--reasoning-parser``) cuts off the thinking first; the answer then goes
through the request's tool parser (``tool_choice`` auto with ``--tool-call-parser``, or the forced
choices' own parsers). Both are pure functions of the text so far that only report what can no longer
change (`tokenos.reasoning.base`, `tokenos.tool_parsers.base`), so `ChoiceReader.feed` can emit
differences while streaming, and the streamed pieces of any chunking add up to `ChoiceReader.read`
of the whole text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tokenos.reasoning import ReasoningParser, ReasoningState
from tokenos.tool_parsers import CallDelta, ParsedCall, StreamDelta, ToolParser, ToolStream


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ChoiceMessage:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


class ChoiceReader:
    """Reads one choice's output; ``max_calls`` = 1 keeps only the first call (parallel_tool_calls
    false)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        reasoning_state: ReasoningState,
        tool_parser: ToolParser | None,
        max_calls: int | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.state = reasoning_state
        self.tool_parser = tool_parser
        self.max_calls = max_calls
        self._text = ""
        self._reasoning = ""  # emitted so far
        self._answer = ""
        self._tools = ToolStream(tool_parser) if tool_parser is not None else None

    def read(self, text: str) -> ChoiceMessage:
        """The whole output's fields (non-streamed)."""
        reasoning, answer = self._split(text, final=True)
        if self.tool_parser is None:
            return ChoiceMessage(reasoning or None, answer or None, [])
        parsed = self.tool_parser.parse(answer, True)
        calls = list(parsed.calls[: self.max_calls])
        return ChoiceMessage(reasoning or None, parsed.content or None, calls)

    def feed(self, delta_text: str, final: bool = False) -> ChoiceDelta:
        """The new pieces after ``delta_text``; ``final`` on the last delta flushes what was held back."""
        self._text += delta_text
        reasoning, answer = self._split(self._text, final)
        out = ChoiceDelta(reasoning=_grown(self._reasoning, reasoning))
        self._reasoning += out.reasoning
        answer_delta = _grown(self._answer, answer)
        self._answer += answer_delta
        if self._tools is None:
            out.content = answer_delta
            return out
        tools = self._tools.feed(answer_delta)
        if final:
            tools = _merge(tools, self._tools.finish())
        out.content = tools.content
        out.calls = [c for c in tools.calls if self.max_calls is None or c.index < self.max_calls]
        return out

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, self.state, final)


def _grown(emitted: str, now: str) -> str:
    """What ``now`` adds to ``emitted`` (nothing if it would retract: never for a correct parser)."""
    return now[len(emitted) :] if now.startswith(emitted) else ""


def _merge(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    """Two deltas as one: a call's fragments joined, its name from whichever delta has it."""
    calls: dict[int, CallDelta] = {}
    for call in (*first.calls, *second.calls):
        seen = calls.get(call.index)
        if seen is None:
            calls[call.index] = call
        else:
            calls[call.index] = CallDelta(call.index, seen.name or call.name, seen.arguments + call.arguments)
    return StreamDelta(content=first.content + second.content, calls=tuple(calls.values()))
