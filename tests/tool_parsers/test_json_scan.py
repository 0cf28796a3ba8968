"""The JSON-object prefix scanner: members, spans, decoded strings, closing and breaking."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tool_parsers.strategies import arguments, dumps
from tokenos.tool_parsers.json_scan import Member, scan_object


def spans(text: str) -> list[tuple[str, str | None]]:
    scan = scan_object(text, 0)
    return [(m.key, text[m.start : m.end] if m.end is not None else None) for m in scan.members]


def test_members_and_spans() -> None:
    text = '{"a": 1, "b" : "x\\"}", "c": [1, {"d": []}], "e": true, "f": null, "g": -2.5e-3}'
    scan = scan_object(text, 0)
    assert scan.closed and not scan.broken and scan.stop == len(text)
    assert spans(text) == [
        ("a", "1"),
        ("b", '"x\\"}"'),
        ("c", '[1, {"d": []}]'),
        ("e", "true"),
        ("f", "null"),
        ("g", "-2.5e-3"),
    ]
    assert scan.first("b").string == 'x"}'
    assert scan.first("c", "a").key == "a"


def test_decoded_strings() -> None:
    scan = scan_object('{"caf\\u00e9": "\\u00e9\\n\\\\", "raw": "a\nb", "bad": "\\q"}', 0)
    assert [m.key for m in scan.members] == ["café", "raw", "bad"]
    assert [m.string for m in scan.members] == ["é\n\\", "a\nb", "\\q"]


def test_incomplete() -> None:
    assert spans('{"a": {"b": [1, "]') == [("a", None)]
    assert scan_object('{"a": 12', 0).members == (Member("a", 6, None),)  # the number may grow
    assert spans('{"a": 1, "b') == [("a", "1")]
    scan = scan_object('{"a": "x', 0)
    assert not scan.closed and not scan.broken and scan.stop == 8


def test_broken() -> None:
    for text, at in [
        ('{"a": 1 "b": 2}', 8),
        ('{"a": [1}', 8),
        ('{"a": <x>}', 6),
        ("{a: 1}", 1),
        ('{"a" 1}', 5),
    ]:
        scan = scan_object(text, 0)
        assert scan.broken and scan.stop == at, text


def test_starts_anywhere_and_stops_at_the_brace() -> None:
    text = 'xx{"a": {}} tail'
    scan = scan_object(text, 2)
    assert scan.closed and text[scan.stop :] == " tail"


def test_long_unterminated_string_is_linear() -> None:
    # Would take minutes with a backtracking string pattern.
    text = '{"a": "' + "\\x" * 200_000
    assert scan_object(text, 0).stop == len(text)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_dumped_objects(data: st.DataObject) -> None:
    value = data.draw(arguments)
    text = data.draw(dumps(value))
    scan = scan_object(text, 0)
    assert scan.closed and scan.stop == len(text)
    assert {m.key: json.loads(text[m.start : m.end]) for m in scan.members} == value
    prefix = scan_object(text[: data.draw(st.integers(1, len(text)))], 0)
    # Prefix-stable: the same members, the last one possibly still open, and never broken.
    assert not prefix.broken
    for early, late in zip(prefix.members, scan.members, strict=False):
        assert (early.key, early.start) == (late.key, late.start)
        assert early.end in (None, late.end)
    assert all(m.end is not None for m in prefix.members[:-1])
