"""The user-selectable tool parsers by name (``--tool-call-parser NAME``).

Parser modules register themselves with `register_tool_parser`; importing `tokenos.tool_parsers` imports
them all. The forced-choice parsers (tool_choice "required" or a named function) are chosen by the request,
not by the user, so they stay out of this table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tokenos.tool_parsers.base import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {}

P = TypeVar("P", bound=type[ToolParser])


def register_tool_parser(name: str) -> Callable[[P], P]:
    def register(cls: P) -> P:
        if name in TOOL_PARSERS and TOOL_PARSERS[name] is not cls:
            raise ValueError(f"tool parser {name!r} is already registered ({TOOL_PARSERS[name].__name__})")
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known parsers: {known}") from None
