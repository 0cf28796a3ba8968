"""Reasoning parsers: where the output starts (read off the prompt), the split of canned outputs, and
the streaming property: for any chunking, the pieces emitted from the conservative splits of the growing
text add up to the final split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenos.reasoning import REASONING_PARSERS, ReasoningState, get_reasoning_parser

R, O, E = ReasoningState.REASONING, ReasoningState.OPEN, ReasoningState.ENDED


def test_registry_names_the_known_parsers():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize(
    ("name", "prompt", "state"),
    [
        ("deepseek_r1", "<|User|>hi<|Assistant|><think>\n", R),
        ("deepseek_r1", "<|User|>hi<|Assistant|>", R),  # R1 thinks whether or not the template opened it
        ("qwen3", "<|im_start|>assistant\n", O),  # the model may open <think> itself
        ("qwen3", "<|im_start|>assistant\n<think>\n", R),  # thinking variants open it in the template
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", E),  # enable_thinking: false
        # an earlier turn's thinking, not at the tail, says nothing about this turn
        ("qwen3", "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", O),
        ("qwen3", None, O),
    ],
)
def test_initial_state_from_the_prompt_tail(name, prompt, state):
    assert get_reasoning_parser(name).initial_state(prompt) == state


CASES = [
    # (state, output, (reasoning, answer))
    (R, "Let me think.\n</think>\n\nThe answer is 4.", ("Let me think.\n", "The answer is 4.")),
    (R, "<think>\nhmm</think>ok", ("hmm", "ok")),
    (R, "still thinking when cut", ("still thinking when cut", "")),
    (R, "cut in the end marker </thi", ("cut in the end marker </thi", "")),
    (O, "<think>plan</think>\nanswer", ("plan", "answer")),
    (O, "no thinking at all", ("", "no thinking at all")),
    (O, "<thinking is not the marker", ("", "<thinking is not the marker")),
    (O, "", ("", "")),
    (E, "<think>literal</think> text", ("", "<think>literal</think> text")),
]


@pytest.mark.parametrize(("state", "text", "expected"), CASES)
def test_split(state, text, expected):
    assert get_reasoning_parser("qwen3").split(text, state) == expected


def _stream(parser, state, chunks: list[str]) -> tuple[str, str]:
    text, reasoning, answer = "", "", ""
    for i, chunk in enumerate(chunks):
        text += chunk
        r, a = parser.split(text, state, final=i == len(chunks) - 1)
        assert r.startswith(reasoning) and a.startswith(answer), (text, r, a)
        reasoning, answer = r, a
    return reasoning, answer


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]


PIECES = ["<think>", "</think>", "<", "</", "<thi", "</th", "\n", " ", "plan", "x", ">", "answer"]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    state=st.sampled_from([R, O, E]),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
)
def test_streamed_pieces_add_up_to_the_final_split(name, state, pieces, cuts):
    parser = get_reasoning_parser(name)
    text = "".join(pieces)
    assert _stream(parser, state, _chunks(text, cuts)) == parser.split(text, state, final=True)
    # one character at a time, the finest chunking
    assert _stream(parser, state, list(text) or [""]) == parser.split(text, state, final=True)
