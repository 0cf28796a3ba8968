"""Tool-call parsers: model output text -> content + OpenAI tool calls, streamed or not.

Every parser is one pure function ``parse(text, final)`` over the whole text so far, monotone in the text
(see base), so `ToolStream`'s deltas always add up to the non-streamed parse. The user-selectable parsers
are registered by name in `TOOL_PARSERS` (importing this package registers them all); the forced-choice
parsers, `RequiredToolsParser` and `NamedToolParser`, are picked by the request's tool_choice instead.
"""

from tokenos.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParseResult,
    StreamDelta,
    ToolParser,
    ToolStream,
)
from tokenos.tool_parsers.forced import NamedToolParser, RequiredToolsParser
from tokenos.tool_parsers.hermes import HermesToolParser
from tokenos.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenos.tool_parsers.pythonic import PythonicToolParser
from tokenos.tool_parsers.registry import TOOL_PARSERS, get_tool_parser, register_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "CallDelta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedToolParser",
    "ParseResult",
    "ParsedCall",
    "PythonicToolParser",
    "RequiredToolsParser",
    "StreamDelta",
    "ToolParser",
    "ToolStream",
    "get_tool_parser",
    "register_tool_parser",
]
