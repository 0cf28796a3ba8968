"""Hypothesis strategies: random JSON-able arguments and random renderings of them in each format.

Each `*_outputs` strategy returns (text, expected content, expected calls as (name, arguments) pairs), where
the arguments are the Python values the call's arguments must decode to.
"""

from __future__ import annotations

import json
import keyword
from typing import Any

from hypothesis import strategies as st

# Characters that matter to the parsers, mixed into strings so that tags, quotes, brackets and escapes
# show up inside JSON strings and around calls far more often than in uniform text.
TRICKY = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "<|python_tag|>",
    '"',
    "'",
    "\\",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ";",
    ",",
    ":",
    "\n",
    " ",
    "é",
    "☕",
    "\u2028",
    "\x00",
    "😀",
]

strings = st.one_of(st.text(max_size=6), st.lists(st.sampled_from(TRICKY), max_size=4).map("".join))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    strings,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(strings, inner, max_size=3)),
    max_leaves=6,
)
arguments = st.dictionaries(strings, json_values, max_size=4)
whitespace = st.sampled_from(["", " ", "\n", "\n\n", " \t "])


@st.composite
def dumps(draw: st.DrawFn, value: Any) -> str:
    """`value` as JSON, with random indentation, separators and ASCII escaping."""
    indent = draw(st.sampled_from([None, 0, 2, "\t"]))
    separators = draw(st.sampled_from([None, (",", ":"), (", ", ": "), (" ,", " : ")]))
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))


@st.composite
def call_objects(draw: st.DrawFn, argument_key: str) -> tuple[str, tuple[str, dict]]:
    """A call as a JSON object: name and arguments in either order, the arguments key sometimes omitted
    when empty, sometimes an extra member."""
    name = draw(st.text(min_size=1, max_size=8))
    args = draw(arguments)
    members: list[tuple[str, Any]] = [("name", name)]
    if args or draw(st.booleans()):
        members.append((argument_key, args))
    if draw(st.booleans()):
        members.reverse()
    if draw(st.booleans()):
        members.insert(draw(st.integers(0, len(members))), ("id", draw(strings)))
    return draw(dumps(dict(members))), (name, args)


def content_text(forbidden: str | None = None) -> st.SearchStrategy[str]:
    pieces = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(max_size=4)), max_size=5).map("".join)
    return pieces if forbidden is None else pieces.filter(lambda text: forbidden not in text)


@st.composite
def hermes_outputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    outside = content_text(forbidden="<tool_call>")
    count = draw(st.integers(0, 3))
    parts = [draw(outside)]
    text, calls = parts[0], []
    for _ in range(count):
        obj, call = draw(call_objects(draw(st.sampled_from(["arguments", "parameters"]))))
        text += f"<tool_call>{draw(whitespace)}{obj}{draw(whitespace)}</tool_call>"
        parts.append(draw(outside))
        text += parts[-1]
        calls.append(call)
    return text, "".join(parts).strip(), calls


@st.composite
def llama3_outputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    text = draw(whitespace) + draw(st.sampled_from(["", "<|python_tag|>"]))
    calls = []
    for index in range(draw(st.integers(1, 3))):
        obj, call = draw(call_objects(draw(st.sampled_from(["parameters", "arguments"]))))
        if index:
            text += draw(st.sampled_from([";", "; ", "\n", " ;\n", " "]))
        text += obj
        calls.append(call)
    content = ""
    if draw(st.booleans()):
        # Trailing content must not begin like another object (or a separator, which would be skipped).
        content = draw(st.sampled_from(["That", "<", "]", "x"])) + draw(content_text())
        text += draw(whitespace) + content
    return text + draw(whitespace), content.strip(), calls


identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)
)


@st.composite
def python_literal(draw: st.DrawFn, value: Any) -> str:
    if isinstance(value, str) and draw(st.booleans()):
        return json.dumps(value, ensure_ascii=False)  # a double-quoted literal Python reads the same way
    return repr(value)


@st.composite
def pythonic_outputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    calls, rendered = [], []
    for _ in range(draw(st.integers(1, 3))):
        name = ".".join(draw(st.lists(identifiers, min_size=1, max_size=2)))
        kwargs = draw(st.dictionaries(identifiers, json_values, max_size=3))
        sep = draw(st.sampled_from([", ", ",", ",\n  "]))
        body = sep.join(f"{key}={draw(python_literal(value))}" for key, value in kwargs.items())
        rendered.append(f"{name}({body})")
        calls.append((name, kwargs))
    text = (
        draw(whitespace) + "[" + draw(whitespace) + draw(st.sampled_from([", ", ",", ",\n"])).join(rendered)
    )
    text += draw(whitespace) + "]"
    content = draw(content_text())
    return text + content, content.strip(), calls


@st.composite
def required_outputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict]]]:
    calls = draw(st.lists(st.tuples(st.text(min_size=1, max_size=8), arguments), max_size=3))
    key = draw(st.sampled_from(["parameters", "arguments"]))
    text = draw(dumps([{"name": name, key: args} for name, args in calls]))
    return draw(whitespace) + text + draw(whitespace), "", calls
