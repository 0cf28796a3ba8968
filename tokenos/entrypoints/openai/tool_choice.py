"""What a chat request's ``tools`` and ``tool_choice`` ask for, as OpenAI and vLLM define it.

- ``none``: the tools reach the template, the output is plain text;
- ``auto`` (the default when tools are given): the model chooses, and the server's tool parser
  (``--enable-auto-tool-choice --tool-call-parser NAME``) reads any calls out of its text;
- ``required``: a grammar forces a JSON array of one or more calls to the given tools, each an
  object ``{"name": ..., "parameters": ...}`` whose parameters follow that tool's schema;
- a named function: a grammar forces that function's parameters object.

The two forced choices are enforced by structured output (`tokenos.structured`), so a random-weight
model still produces calls that parse. Everything here works on plain dicts (the protocol's models
dumped), so the wire format and this policy stay apart.
"""

from __future__ import annotations

import re
from typing import Any

# Any object, for a tool defined without parameters.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolChoiceError(ValueError):
    """A tools / tool_choice combination that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def function_names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """ "none", "auto", "required" or the forced function's name; None when there are no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools: give the tools it may call.", "tool_choice")
        return None
    names = function_names(tools)
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ToolChoiceError(f"Each tool needs its own name; repeated: {duplicated}.", "tools")
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        return tool_choice
    name = tool_choice["function"]["name"]
    if name not in names:
        raise ToolChoiceError(
            f"tool_choice names the function {name!r}, which is not among the tools {names}.", "tool_choice"
        )
    return name


def is_forced(choice: str | None) -> bool:
    """The choice is enforced by a grammar ("required" or a named function)."""
    return choice not in (None, "none", "auto")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def forced_schema(tools: list[dict[str, Any]], choice: str, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema the output must follow for a forced choice."""
    if choice != "required":
        (tool,) = [t for t in tools if t["function"]["name"] == choice]
        return _parameters(tool)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_TOOLS_VARIABLE = re.compile(r"\btools\b")


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (one that does not would drop them)."""
    return bool(template) and _TOOLS_VARIABLE.search(template) is not None
