"""Grammar masks start after the thinking: a matcher wrapped so that reasoning tokens are free.

With a reasoning parser, a request's grammar constrains its answer only. `ReasoningGate` sits between
the scheduler and the grammar's matcher and follows the output token by token from the state the front
door read off the prompt (`tokenos.reasoning.ReasoningState`):

- REASONING: every token is allowed and none reaches the grammar, until the output ends with the end
  marker's tokens; from the next token on the grammar is in force.
- OPEN: the first token may open the thinking: the mask is the grammar's plus the start marker's first
  token; once that is taken the rest of the marker is forced and the state is REASONING. Any other first
  token is the answer's and goes to the grammar.
- ENDED: the grammar from the first token.

Markers are token sequences (the tokenizer's encoding of ``<think>`` / ``</think>``: one added token
in real reasoning models).
"""

from __future__ import annotations

import numpy as np

from tokenos.reasoning.base import ReasoningState
from tokenos.structured.backend import Matcher

_ACTIVE = 0  # the grammar is in force


class ReasoningGate:
    def __init__(
        self, matcher: Matcher, state: ReasoningState, start_ids: list[int], end_ids: list[int]
    ) -> None:
        if not start_ids or not end_ids:
            raise ValueError("reasoning markers must encode to at least one token")
        self._m = matcher
        self._start = start_ids
        self._end = end_ids
        self._state = _ACTIVE if state == ReasoningState.ENDED else int(state)
        self._opened = 0  # tokens of the start marker taken so far (state OPEN)
        self._tail: list[int] = []  # the last len(end) reasoning tokens

    @property
    def in_force(self) -> bool:
        """The grammar constrains the next token."""
        return self._state == _ACTIVE

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._state == _ACTIVE:
            self._m.fill_bitmask(bitmask, row)
        elif self._state == ReasoningState.REASONING:
            bitmask[row] = -1
        elif self._opened:  # inside the start marker: its next token only
            _allow_only(bitmask, row, self._start[self._opened])
        else:
            self._m.fill_bitmask(bitmask, row)
            token = self._start[0]
            bitmask[row, token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))

    def accept(self, token_id: int) -> bool:
        if self._state == _ACTIVE:
            return self._m.accept(token_id)
        if self._state == ReasoningState.OPEN:
            return self._accept_open(token_id)
        self._tail.append(token_id)
        del self._tail[: -len(self._end)]
        if self._tail == self._end:
            self._state = _ACTIVE
        return True

    def _accept_open(self, token_id: int) -> bool:
        if token_id == self._start[self._opened]:
            self._opened += 1
            if self._opened == len(self._start):
                self._state = ReasoningState.REASONING
            return True
        if self._opened:  # left the start marker midway: the mask forbade it
            return False
        self._state = _ACTIVE
        return self._m.accept(token_id)

    @property
    def takes_drafts(self) -> bool:
        """Speculative drafts only once the grammar is active: thinking tokens do not roll back."""
        return self._state == _ACTIVE

    def rollback(self, num_tokens: int) -> None:
        if self._state != _ACTIVE:
            raise NotImplementedError("rolling back reasoning tokens is not supported")
        self._m.rollback(num_tokens)

    def validate(self, token_ids: list[int]) -> int:
        return self._m.validate(token_ids) if self._state == _ACTIVE else len(token_ids)

    def is_terminated(self) -> bool:
        return self._state == _ACTIVE and self._m.is_terminated()

    def error(self) -> str | None:
        return self._m.error()


def _allow_only(bitmask: np.ndarray, row: int, token: int) -> None:
    bitmask[row] = 0
    bitmask[row, token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
