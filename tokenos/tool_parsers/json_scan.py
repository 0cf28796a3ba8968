"""A prefix scanner for one JSON object: its top-level keys and where each value lies in the text.

`scan_object(text, start)` reads the object whose ``{`` is at ``text[start]`` and reports, in text order,
every top-level member whose value has started: its key, the span of its value (``end`` None while the
value is incomplete) and, for a complete string value, the decoded string. It also says whether the object
closed (and where) or where the text stopped being a JSON object ("broken").

Invariants the tool parsers rely on:

- Prefix-stable: scanning a prefix of a text gives the same members, in the same order, as scanning the
  whole text, except that the last one may be incomplete there, and the prefix's scan stops at its end
  unless it closed or broke before. A prefix never breaks where the whole text does not.
- Linear: one pass, and the long runs (string bodies, whitespace, numbers, the insides of nested values)
  are skipped by possessive regexes, so a parse that rescans the whole text per token stays cheap.
- Lenient where the raw text is kept anyway: inside nested values only bracket matching, strings and the
  characters JSON can have there (whitespace, word characters, ``.,:+-``) are checked; string bodies may
  hold raw control characters and unknown escapes. A ``<`` (a tag) or ``;`` outside strings breaks it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = re.compile(r"\s*+")
# Unrolled and possessive: fails in one pass on an unterminated string, however long.
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
_SCALAR = re.compile(r"[\w.+\-]++")
_FILLER = re.compile(r"[\s\w.,:+\-]*+")
_CLOSER = {"{": "}", "[": "]"}


@dataclass(frozen=True)
class Member:
    key: str
    start: int  # index of the value's first character
    end: int | None  # one past the value's last character; None while the value is incomplete
    string: str | None = None  # the decoded value, when it is a complete string


@dataclass(frozen=True)
class ObjectScan:
    members: tuple[Member, ...]
    stop: int  # one past the closing brace, the index where it broke, or len(text) while open
    closed: bool = False
    broken: bool = False

    def first(self, *keys: str) -> Member | None:
        """The first member, in text order, whose key is one of `keys`."""
        return next((member for member in self.members if member.key in keys), None)


def decode_string(raw: str) -> str:
    """The value of a complete JSON string literal; a bad escape keeps the raw body rather than fail."""
    try:
        return json.loads(raw, strict=False)
    except json.JSONDecodeError:
        return raw[1:-1]


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def scan_object(text: str, start: int) -> ObjectScan:
    assert text.startswith("{", start), "scan_object starts at a brace"
    members: list[Member] = []
    pos = skip_ws(text, start + 1)

    def stopped(at: int, **state: bool) -> ObjectScan:
        return ObjectScan(tuple(members), at, **state)

    while True:
        if pos == len(text):
            return stopped(pos)
        if text[pos] == "}":  # also after a trailing comma: harmless leniency
            return stopped(pos + 1, closed=True)
        if text[pos] != '"':
            return stopped(pos, broken=True)
        key = _STRING.match(text, pos)
        if key is None:
            return stopped(len(text))
        pos = skip_ws(text, key.end())
        if pos == len(text):
            return stopped(pos)
        if text[pos] != ":":
            return stopped(pos, broken=True)
        value_start = skip_ws(text, pos + 1)
        if value_start == len(text):
            return stopped(value_start)
        value_end, broken_at = value_span(text, value_start)
        if value_end is None:
            members.append(Member(decode_string(key.group()), value_start, None))
            return stopped(broken_at, broken=True) if broken_at is not None else stopped(len(text))
        string = decode_string(text[value_start:value_end]) if text[value_start] == '"' else None
        members.append(Member(decode_string(key.group()), value_start, value_end, string))
        pos = skip_ws(text, value_end)
        if pos == len(text):
            return stopped(pos)
        if text[pos] == ",":
            pos = skip_ws(text, pos + 1)
        elif text[pos] == "}":
            return stopped(pos + 1, closed=True)
        else:
            return stopped(pos, broken=True)


def value_span(text: str, start: int) -> tuple[int | None, int | None]:
    """(end, None) for a complete value at `start`, (None, None) while incomplete, (None, i) broken at i."""
    first = text[start]
    if first == '"':
        string = _STRING.match(text, start)
        return (string.end(), None) if string else (None, None)
    if first in _CLOSER:
        return _nested_span(text, start)
    scalar = _SCALAR.match(text, start)
    if scalar is None:
        return None, start
    # A number or literal touching the end of the text may still grow.
    return (scalar.end(), None) if scalar.end() < len(text) else (None, None)


def _nested_span(text: str, start: int) -> tuple[int | None, int | None]:
    return bracket_span(text, start + 1, _CLOSER[text[start]], _FILLER, {'"': _STRING}, _CLOSER)


def bracket_span(
    text: str,
    pos: int,
    closer: str,
    filler: re.Pattern[str],
    strings: dict[str, re.Pattern[str]],
    openers: dict[str, str],
) -> tuple[int | None, int | None]:
    """Scan from `pos`, just inside a bracket that `closer` closes: (one past that closer, None);
    (None, None) while it is still open (also inside an unfinished string); (None, i) at a character
    that breaks it (a mismatched closer, or one `filler` does not skip). `strings` maps each quote to
    its string's pattern, `openers` each opening bracket to its closer; the same scan serves JSON values
    and Python calls."""
    expected = [closer]
    while True:
        pos = filler.match(text, pos).end()
        if pos == len(text):
            return None, None
        char = text[pos]
        if char in strings:
            string = strings[char].match(text, pos)
            if string is None:
                return None, None
            pos = string.end()
        elif char in openers:
            expected.append(openers[char])
            pos += 1
        elif char == expected[-1]:
            expected.pop()
            pos += 1
            if not expected:
                return pos, None
        else:
            return None, pos
