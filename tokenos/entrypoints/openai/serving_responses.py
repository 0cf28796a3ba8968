"""POST /v1/responses: OpenAI's Responses API for text, served by the chat path.

The request becomes the chat request it means (`ResponsesRequest.to_chat_request`); the chat completion
(or its stream of chunks) becomes output items: a ``reasoning`` item for reasoning_content, a ``message``
with one ``output_text`` part for content, and a ``function_call`` item per tool call. A streamed response
is OpenAI's event sequence: response.created / in_progress, then per item output_item.added, its deltas
(output_text.delta, reasoning_text.delta, function_call_arguments.delta) and their .done events, then
response.completed (or response.incomplete when max_output_tokens cut it), every event numbered.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenos.entrypoints.openai.protocol import ChatCompletionResponse
from tokenos.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
)
from tokenos.entrypoints.openai.serving_chat import OpenAIServingChat


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: Any) -> ResponsesUsage | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponsesUsage(
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        input_tokens_details={"cached_tokens": cached},
    )


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(
        self, request: ResponsesRequest, raw_request: Any = None
    ) -> ResponseObject | AsyncIterator[str]:
        chat_request = request.to_chat_request()
        result = await self.chat.create_chat_completion(chat_request, raw_request)
        shell = self._shell(request, chat_request.model or self.chat.served_model_names[0])
        if isinstance(result, ChatCompletionResponse):
            return self._complete(shell, result)
        return _Events(shell, result).run()

    def _shell(self, request: ResponsesRequest, model: str) -> ResponseObject:
        return ResponseObject(
            id=_id("resp"),
            model=model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            parallel_tool_calls=request.parallel_tool_calls,
            tool_choice=request.tool_choice or "auto",
            tools=request.tools or [],
            text=request.text or {"format": {"type": "text"}},
            metadata=request.metadata or {},
            user=request.user,
        )

    def _complete(self, shell: ResponseObject, chat: ChatCompletionResponse) -> ResponseObject:
        choice = chat.choices[0]
        message = choice.message
        if message.reasoning_content:
            shell.output.append(
                ReasoningItem(id=_id("rs"), content=[ReasoningText(text=message.reasoning_content)])
            )
        if message.content:
            shell.output.append(OutputMessage(id=_id("msg"), content=[OutputText(text=message.content)]))
        for call in message.tool_calls:
            item = FunctionCallItem(
                id=_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments
            )
            shell.output.append(item)
        _finish(shell, choice.finish_reason)
        shell.usage = _usage(chat.usage.model_dump() if chat.usage else None)
        return shell


def _finish(shell: ResponseObject, finish_reason: str | None) -> None:
    if finish_reason == "length":
        shell.status = "incomplete"
        shell.incomplete_details = {"reason": "max_output_tokens"}
    else:
        shell.status = "completed"


class _Events:
    """One streamed response: chat chunks in, Responses events out."""

    def __init__(self, shell: ResponseObject, chunks: AsyncIterator[str]) -> None:
        self.shell = shell
        self.chunks = chunks
        self.sequence = 0
        self.open: dict[
            str, tuple[int, Any]
        ] = {}  # "reasoning" / "message" / call index -> (output index, item)
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def snapshot(self, status: str) -> dict[str, Any]:
        data = self.shell.model_dump()
        data["status"] = status
        return data

    async def run(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.snapshot("in_progress"))
        yield self.event("response.in_progress", response=self.snapshot("in_progress"))
        async for line in self.chunks:
            if not line.startswith("data: ") or line.startswith("data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                for out in self.close_all():
                    yield out
                self.shell.status = "failed"
                self.shell.error = {
                    "code": chunk["error"].get("code") or "server_error",
                    "message": chunk["error"]["message"],
                }
                yield self.event("response.failed", response=self.shell.model_dump())
                return
            if chunk.get("usage"):
                self.shell.usage = _usage(chunk["usage"])
            for choice in chunk.get("choices", []):
                for out in self.delta(choice.get("delta") or {}):
                    yield out
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        for out in self.close_all():
            yield out
        _finish(self.shell, self.finish_reason)
        kind = "response.incomplete" if self.shell.status == "incomplete" else "response.completed"
        yield self.event(kind, response=self.shell.model_dump())

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self.text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self.text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self.call_delta(call)
        return out

    def add_item(self, key: str, item: Any) -> list[str]:
        index = len(self.shell.output)
        self.shell.output.append(item)
        self.open[key] = (index, item)
        added = item.model_dump()
        added["status"] = "in_progress"
        return [self.event("response.output_item.added", output_index=index, item=added)]

    def item_event(self, kind: str, index: int, item: Any, **fields: Any) -> str:
        """An event about output item `item` (at `index`)."""
        return self.event(kind, item_id=item.id, output_index=index, **fields)

    def text_delta(self, key: str, text: str) -> list[str]:
        out: list[str] = []
        if key not in self.open:
            if key == "reasoning":
                out += self.add_item(key, ReasoningItem(id=_id("rs"), content=[ReasoningText(text="")]))
            else:
                out += self.add_item(key, OutputMessage(id=_id("msg"), content=[OutputText(text="")]))
                part = {"type": "output_text", "text": "", "annotations": []}
                out.append(
                    self.item_event(
                        "response.content_part.added", *self.open[key], content_index=0, part=part
                    )
                )
        index, item = self.open[key]
        item.content[0].text += text
        if key == "reasoning":
            out.append(
                self.item_event("response.reasoning_text.delta", index, item, content_index=0, delta=text)
            )
        else:
            out.append(
                self.item_event(
                    "response.output_text.delta", index, item, content_index=0, delta=text, logprobs=[]
                )
            )
        return out

    def call_delta(self, call: dict[str, Any]) -> list[str]:
        key = f"call{call['index']}"
        function = call.get("function") or {}
        out: list[str] = []
        if key not in self.open:
            item = FunctionCallItem(
                id=_id("fc"),
                call_id=call.get("id") or _id("call"),
                name=function.get("name") or "",
                arguments="",
            )
            out += self.add_item(key, item)
        index, item = self.open[key]
        if function.get("arguments"):
            item.arguments += function["arguments"]
            out.append(
                self.item_event(
                    "response.function_call_arguments.delta", index, item, delta=function["arguments"]
                )
            )
        return out

    def close_all(self) -> list[str]:
        out: list[str] = []
        for key, (index, item) in sorted(self.open.items(), key=lambda kv: kv[1][0]):
            if key == "message":
                text = item.content[0].text
                out.append(
                    self.item_event(
                        "response.output_text.done", index, item, content_index=0, text=text, logprobs=[]
                    )
                )
                part = item.content[0].model_dump()
                out.append(
                    self.item_event("response.content_part.done", index, item, content_index=0, part=part)
                )
            elif key == "reasoning":
                text = item.content[0].text
                out.append(
                    self.item_event("response.reasoning_text.done", index, item, content_index=0, text=text)
                )
            else:
                args = item.arguments
                out.append(
                    self.item_event("response.function_call_arguments.done", index, item, arguments=args)
                )
            out.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        self.open.clear()
        return out
