"""The user-selectable parsers by name."""

from __future__ import annotations

import pytest

from tokenos.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    NamedToolParser,
    RequiredToolsParser,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)


def test_get_known_parsers() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "pythonic"}
    for name, cls in TOOL_PARSERS.items():
        assert cls.name == name
        assert isinstance(cls(None), ToolParser)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        get_tool_parser("mistral")


def test_forced_parsers_are_not_user_selectable() -> None:
    assert RequiredToolsParser not in TOOL_PARSERS.values()
    assert NamedToolParser not in TOOL_PARSERS.values()


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes")(type("Other", (HermesToolParser,), {}))
