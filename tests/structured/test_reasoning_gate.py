"""The reasoning gate: a grammar in force only after the thinking, from each start state."""

from __future__ import annotations

import numpy as np
import pytest

from tokenos.reasoning import ReasoningState
from tokenos.structured.backend import bitmask_words
from tokenos.structured.reasoning_gate import ReasoningGate

VOCAB = 100
START, END = [7, 8], [9]
GRAMMAR_TOKENS = {40, 41, 42}  # what the fake grammar allows; it is done after two tokens


class FakeMatcher:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        for t in GRAMMAR_TOKENS:
            bitmask[row, t >> 5] |= np.int32(1 << (t & 31))

    def accept(self, token_id: int) -> bool:
        if token_id not in GRAMMAR_TOKENS:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def validate(self, token_ids: list[int]) -> int:
        return next((i for i, t in enumerate(token_ids) if t not in GRAMMAR_TOKENS), len(token_ids))

    def is_terminated(self) -> bool:
        return len(self.accepted) >= 2

    def error(self) -> str | None:
        return None


def allowed(gate: ReasoningGate) -> set[int]:
    mask = np.zeros((1, bitmask_words(VOCAB)), dtype=np.int32)
    gate.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_reasoning_is_free_until_the_end_marker():
    matcher = FakeMatcher()
    gate = ReasoningGate(matcher, ReasoningState.REASONING, START, END)
    assert allowed(gate) == set(range(VOCAB)) and not gate.in_force
    for token in (3, 99, 7, 8):  # anything, even the start marker again
        assert gate.accept(token) and not gate.is_terminated()
    assert gate.accept(9) and gate.in_force  # the end marker: the grammar from the next token on
    assert matcher.accepted == [] and allowed(gate) == GRAMMAR_TOKENS
    assert not gate.accept(3)  # now the grammar decides
    assert gate.accept(40) and gate.accept(41) and gate.is_terminated()


def test_open_output_may_start_thinking_or_answer():
    answer = ReasoningGate(FakeMatcher(), ReasoningState.OPEN, START, END)
    assert allowed(answer) == GRAMMAR_TOKENS | {START[0]}
    assert answer.accept(40) and answer.in_force  # the answer's first token went to the grammar

    thinking = ReasoningGate(FakeMatcher(), ReasoningState.OPEN, START, END)
    assert thinking.accept(START[0])
    assert allowed(thinking) == {START[1]}  # the rest of the start marker is forced
    assert thinking.accept(START[1]) and allowed(thinking) == set(range(VOCAB))
    assert thinking.accept(9) and thinking.in_force


def test_ended_means_the_grammar_from_the_first_token():
    gate = ReasoningGate(FakeMatcher(), ReasoningState.ENDED, START, END)
    assert gate.in_force and allowed(gate) == GRAMMAR_TOKENS


def test_multi_token_end_marker_must_appear_in_a_row():
    gate = ReasoningGate(FakeMatcher(), ReasoningState.REASONING, START, [5, 6])
    for token in (5, 1, 6):
        gate.accept(token)
    assert not gate.in_force
    gate.accept(5)
    gate.accept(6)
    assert gate.in_force


def test_markers_must_be_tokens():
    with pytest.raises(ValueError):
        ReasoningGate(FakeMatcher(), ReasoningState.REASONING, [], END)
