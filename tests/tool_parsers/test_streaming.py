"""The streaming contract for every parser: for any chunking, the concatenated ToolStream deltas equal the
non-streamed parse, because every non-final parse of a prefix is "<=" every later one.

Checked on the canned outputs of the per-parser tests (every prefix, and random chunkings) and on random
well-formed outputs of each format, whose calls must also decode back to the generated arguments.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tool_parsers import strategies
from tests.tool_parsers.checks import assert_prefixes_monotone, assert_stream, split
from tests.tool_parsers.test_forced import NAMED_CASES, REQUIRED_CASES
from tests.tool_parsers.test_hermes import CASES as HERMES_CASES
from tests.tool_parsers.test_llama3_json import CASES as LLAMA3_CASES
from tests.tool_parsers.test_pythonic import CASES as PYTHONIC_CASES
from tokenos.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    PythonicToolParser,
    RequiredToolsParser,
    ToolParser,
)

PARSERS: dict[str, ToolParser] = {
    "hermes": HermesToolParser(),
    "llama3_json": Llama3JsonToolParser(),
    "pythonic": PythonicToolParser(),
    "required": RequiredToolsParser(),
    "named": NamedToolParser(None, function_name="f"),
}
CANNED = [
    (parser, case.text)
    for parser, items in [
        ("hermes", HERMES_CASES),
        ("llama3_json", LLAMA3_CASES),
        ("pythonic", PYTHONIC_CASES),
        ("required", REQUIRED_CASES),
        ("named", NAMED_CASES),
    ]
    for case in items
]
# Each parser also gets every other format's outputs: text it does not expect must still stream exactly.
FOREIGN = sorted({text for _, text in CANNED})

# None: one-character chunks; otherwise cut points (taken modulo the text's length).
cut_points = st.lists(st.integers(0, 10_000), max_size=12)
chunkings = st.one_of(st.none(), cut_points, cut_points)


def chunk(text: str, cuts: list[int] | None) -> list[str]:
    return list(text) if cuts is None else split(text, cuts)


@pytest.mark.parametrize(("parser", "text"), CANNED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CANNED)])
def test_canned_prefixes_are_monotone(parser: str, text: str) -> None:
    assert_prefixes_monotone(PARSERS[parser], text)


@pytest.mark.parametrize("parser", PARSERS)
def test_foreign_outputs_stream_exactly(parser: str) -> None:
    for text in FOREIGN:
        assert_stream(PARSERS[parser], list(text))


@settings(max_examples=150, deadline=None)
@given(canned=st.sampled_from(CANNED), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_canned_streams(canned: tuple[str, str], cuts: list[int]) -> None:
    parser, text = canned
    assert_stream(PARSERS[parser], split(text, cuts))


def check_generated(parser: str, output: tuple[str, str, list], cuts: list[int] | None) -> None:
    text, content, calls = output
    final = assert_stream(PARSERS[parser], chunk(text, cuts))
    assert final.content == content
    assert [(call.name, json.loads(call.arguments)) for call in final.calls] == calls


@settings(max_examples=40, deadline=None)
@given(output=strategies.hermes_outputs(), cuts=chunkings)
def test_generated_hermes(output: tuple[str, str, list], cuts: list[int] | None) -> None:
    check_generated("hermes", output, cuts)


@settings(max_examples=40, deadline=None)
@given(output=strategies.llama3_outputs(), cuts=chunkings)
def test_generated_llama3_json(output: tuple[str, str, list], cuts: list[int] | None) -> None:
    check_generated("llama3_json", output, cuts)


@settings(max_examples=40, deadline=None)
@given(output=strategies.pythonic_outputs(), cuts=chunkings)
def test_generated_pythonic(output: tuple[str, str, list], cuts: list[int] | None) -> None:
    check_generated("pythonic", output, cuts)


@settings(max_examples=40, deadline=None)
@given(output=strategies.required_outputs(), cuts=chunkings)
def test_generated_required(output: tuple[str, str, list], cuts: list[int] | None) -> None:
    check_generated("required", output, cuts)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), cuts=chunkings)
def test_generated_named(data: st.DataObject, cuts: list[int] | None) -> None:
    args = data.draw(strategies.arguments)
    text = (
        data.draw(strategies.whitespace)
        + data.draw(strategies.dumps(args))
        + data.draw(strategies.whitespace)
    )
    check_generated("named", (text, "", [("f", args)]), cuts)


@settings(max_examples=100, deadline=None)
@given(
    parser=st.sampled_from(sorted(PARSERS)),
    text=st.lists(st.sampled_from(strategies.TRICKY + ['"name"', ":", "f", "=1", " "]), max_size=12).map(
        "".join
    ),
    cuts=chunkings,
)
def test_arbitrary_text_streams_exactly(parser: str, text: str, cuts: list[int] | None) -> None:
    assert_stream(PARSERS[parser], chunk(text, cuts))
