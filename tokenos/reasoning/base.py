"""Reasoning parsers: split a model's output into its reasoning (``<think>...</think>``) and its answer.

A reasoning model thinks first, between a start and an end marker, then answers. Where the output
begins depends on the prompt: a template may open the thinking itself (DeepSeek-R1 and the Qwen3
"thinking" templates end the prompt with ``<think>\\n``), close it (Qwen3 with ``enable_thinking:
false`` ends it with an empty ``<think>\\n\\n</think>``), or leave it to the model. `initial_state`
reads that from the prompt's tail; `split` then cuts the output text.

`split(text, state, final=False)` is conservative for a text that may still grow: it holds back a
trailing partial marker, so every result is a prefix (in both parts) of the result for any longer
text and of the final one. Streaming emits the differences, and the streamed parts add up to the
non-streamed split for any chunking. The engine core gates grammar masks with the same states
(`tokenos.reasoning.gate`): structured output constrains the answer, never the thinking.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar

from tokenos.tool_parsers.base import hold_back_partial


class ReasoningState(IntEnum):
    """Where the output starts. 0 is kept for "no reasoning parser" on the wire."""

    REASONING = 1  # inside the thinking: the answer starts after the end marker
    OPEN = 2  # the output decides: a leading start marker opens the thinking, anything else is the answer
    ENDED = 3  # no thinking: the whole output is the answer


class ReasoningParser:
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Where the output starts when the prompt says nothing: R1 always thinks, Qwen3 may not.
    default_state: ClassVar[ReasoningState]

    def initial_state(self, prompt_text: str | None) -> ReasoningState:
        """The state at the start of the output, from the last marker at the prompt's tail."""
        if prompt_text:
            i, j = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
            if i > j and not prompt_text[i + len(self.start) :].strip():
                return ReasoningState.REASONING
            if j > i and not prompt_text[j + len(self.end) :].strip():
                return ReasoningState.ENDED
        return self.default_state

    def split(self, text: str, state: ReasoningState, final: bool = True) -> tuple[str, str]:
        """(reasoning, answer) of an output that starts in ``state``; both stripped of leading
        whitespace. With ``final=False`` a trailing partial marker is held back."""
        if state == ReasoningState.ENDED:
            return "", text.lstrip()
        body = text.lstrip()
        if not final and self.start.startswith(body):
            return "", ""  # nothing yet, or a prefix of the start marker: undecided
        if body.startswith(self.start):
            body = body[len(self.start) :]
        elif state == ReasoningState.OPEN:
            return "", body
        end = body.find(self.end)
        if end >= 0:
            return body[:end].lstrip(), body[end + len(self.end) :].lstrip()
        if not final:
            body = hold_back_partial(body, self.end)
        return body.lstrip(), ""
