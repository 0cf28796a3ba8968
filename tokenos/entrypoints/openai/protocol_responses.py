"""The `/v1/responses` wire format (OpenAI's Responses API, for text): the request, its translation into
the chat request it means, and the response objects.

A Responses request is a conversation (``input``: a string, or message / function-call items, with
``instructions`` as the system turn) plus the same sampling, structured-output (``text.format``) and tool
options as chat, spelled differently; `ResponsesRequest.to_chat_request` spells them the chat way, so one
path (`OpenAIServingChat`) validates, renders, generates and reads the answer. Fields that need state this
server does not keep (``previous_response_id``, ``conversation``, ``background``) or inputs it cannot take
(images, files) are refused with 400 naming them; ``store`` is accepted, and nothing is stored.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenos.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    NumTopLogprobs,
    OpenAIError,
    RequestModel,
    Temperature,
    TopP,
)


def _refused_if_set(value: Any) -> bool:
    return value is not None and value is not False


# field -> (refused when, why)
_REFUSED = {
    "previous_response_id": (_refused_if_set, "responses are not stored here: send the whole conversation"),
    "conversation": (_refused_if_set, "conversations are not stored here: send the whole conversation"),
    "background": (_refused_if_set, "background responses are not supported"),
    "prompt": (_refused_if_set, "stored prompt templates are not supported"),
    "truncation": (lambda v: v not in (None, "disabled"), "truncation other than disabled is not supported"),
    "include": (lambda v: bool(v), "include is not supported"),
    "max_tool_calls": (_refused_if_set, "max_tool_calls is not supported"),
}


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Temperature = None
    top_p: TopP = None
    top_logprobs: NumTopLogprobs = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None  # OpenAI's: string keys and values
    user: str | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _finite_numbers(self) -> ResponsesRequest:
        """The response echoes parts of the request (tools, text, tool_choice): a number JSON cannot
        write (Infinity, NaN, which Python's reader accepts) is refused here, not met when answering."""
        self.refuse_fields_holding(_not_finite, "`{name}` holds a number that is not finite.")
        return self

    def check_refused(self) -> None:
        extra = self.model_extra or {}
        for name, (refused, why) in _REFUSED.items():
            if name in extra and refused(extra[name]):
                raise OpenAIError(f"{why}: remove `{name}` from the request.", param=name)

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; 400 naming the Responses field at fault."""
        self.check_refused()
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "seed": self.seed,
        }
        if self.top_logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools is not None:
            body["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        body = {k: v for k, v in body.items() if v is not None}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise OpenAIError(f"{where}: {first.get('msg')}", param="input") from None

    def _messages(self) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            messages.append(_message(item))
        if not messages:
            raise OpenAIError("input must not be empty.", param="input")
        return messages


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _text(content: Any) -> str:
    """Input content as text: a string, or input_text / output_text parts (anything else is refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError("A message's content must be text or a list of text parts.", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise OpenAIError(f"Content parts of type {kind!r} are not supported (text only).", param="input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise OpenAIError("Each input item must be an object.", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise OpenAIError(
                f"An input message's role must be user, system, developer or assistant, not {role!r}.",
                param="input",
            )
        return {"role": role, "content": _text(item.get("content", ""))}
    if kind == "function_call":
        call = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": call}],
        }
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output", ""))}
    raise OpenAIError(f"Input items of type {kind!r} are not supported.", param="input")


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise OpenAIError(f"Only function tools are supported, not {kind!r}.", param="tools")
    function = {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError(
                "tool_choice must be none, auto, required or a function by name.", param="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object.", param="text")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise OpenAIError(
        f"text.format type {kind!r} is not supported (text, json_object, json_schema).", param="text"
    )


# ------------------------------------------------------------------ responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: str = "completed"
    role: str = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: str = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ResponsesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "completed"
    model: str
    output: list[OutputMessage | ReasoningItem | FunctionCallItem] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, Any] = Field(default_factory=dict)
    store: bool = False  # nothing is kept
    truncation: str = "disabled"
    user: str | None = None
