"""Reasoning parsers (``--reasoning-parser NAME``): pure Python, used by the chat server to split
``reasoning_content`` from ``content`` and by the engine core to start grammar masks after thinking."""

from __future__ import annotations

from tokenos.reasoning.base import ReasoningParser, ReasoningState
from tokenos.reasoning.parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError naming the known ones otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}.")
    return cls()


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningState", "get_reasoning_parser"]
