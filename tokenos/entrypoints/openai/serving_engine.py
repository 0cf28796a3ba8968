"""What the completion and chat endpoints share: the model check, error mapping, streaming plumbing.

The engine is anything with the `AsyncLLM` surface (`generate`, `abort`, `input_processor`,
`tokenizer`, `model_config`). Tokenization, chat templates and request validation are the front
door's (`engine.input_processor`); its `InvalidRequestError`s become 400s naming their `param`.
A request's outputs are consumed through `merge_outputs`, which interleaves
several prompts' streams and polls the HTTP connection: when the client goes away, pending
generations are cancelled (cancelling `generate` aborts it in the engine core), and the endpoint
also calls `engine.abort` for every request that did not finish.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import Any

from pydantic import BaseModel

from tokenos.core.validation import InvalidRequestError
from tokenos.engine.core_client import EngineDeadError, EngineOverloadedError, RequestFailedError
from tokenos.entrypoints.openai.protocol import OpenAIError, PromptLogprob, UsageInfo

logger = logging.getLogger("tokenos.server")

DISCONNECT_POLL_S = 0.5
# JSON has no -inf: logprobs of impossible tokens are reported as this, as vLLM does.
MIN_LOGPROB = -9999.0


class ClientDisconnected(Exception):
    """The HTTP client went away; the request's generations have been cancelled."""


def sse(payload: BaseModel | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def safe_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def engine_error(e: BaseException) -> OpenAIError:
    """Map an exception out of `engine.generate` to the error the client sees."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"The engine is dead: {e}", status=503, code="engine_dead")
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(f"The server is overloaded: {e}", status=429, code="queue_full", retry_after=1)
    if isinstance(e, RequestFailedError):
        return OpenAIError(f"The engine failed this request: {e}", status=500, code="request_failed")
    if isinstance(e, InvalidRequestError):
        return OpenAIError(e.message, param=e.param)
    if isinstance(e, ValueError):
        return OpenAIError(str(e))
    return OpenAIError(f"Internal error: {type(e).__name__}: {e}", status=500)


async def merge_outputs(
    iterators: list[AsyncIterator[Any]], is_disconnected: Callable[[], Awaitable[bool]] | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """Yield `(i, item)` from several async iterators as items arrive; stop if the client leaves."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(
                pending, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                if is_disconnected is not None and await is_disconnected():
                    raise ClientDisconnected()
                continue
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        # Cancelling a pending `generate` step raises CancelledError inside it: it aborts itself.
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


@dataclass(frozen=True)
class ServingOptions:
    """The server flags that shape responses (vLLM's names)."""

    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_log_requests: bool = False

    @classmethod
    def from_args(cls, args: Any) -> ServingOptions:
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


class OpenAIServing:
    """Base of the endpoint handlers: the engine, the served names and the checks every request needs."""

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        executor: Executor | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_model_len: int = engine.model_config.max_model_len
        self.executor = executor  # where front-door work runs (None: the event loop's default pool)
        self.options = options or ServingOptions()
        # The engine's (AsyncLLM reads them once); an engine without any has none.
        self.generation_defaults: dict = getattr(engine, "generation_defaults", None) or {}

    def with_defaults(self, request: Any) -> Any:
        """The request with the generation config's defaults in the sampling fields it left unset."""
        if not self.generation_defaults:
            return request
        update = {
            name: value
            for name, value in self.generation_defaults.items()
            if name != "max_tokens" and getattr(request, name, 0) is None
        }
        cap = self.generation_defaults.get("max_tokens")
        if cap is not None and request.requested_max_tokens() is None:
            update["max_tokens"] = cap
        return request.model_copy(update=update) if update else request

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread: tokenizing a large prompt must not stall other clients."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def input_processor(self) -> Any:
        return self.engine.input_processor

    def check_model(self, model: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve (neither the base model's
        names nor a loaded LoRA adapter's)."""
        if model is None or model in self.served_model_names or model in self.lora_adapters:
            return model or self.served_model_names[0]
        names = [*self.served_model_names, *self.lora_adapters]
        raise OpenAIError(
            f"The model `{model}` does not exist. This server serves: {', '.join(names)}.",
            status=404,
            param="model",
            code="model_not_found",
        )

    @property
    def lora_adapters(self) -> dict[str, dict]:
        """Loaded LoRA adapters by name (the engine's; none for an engine without LoRA)."""
        return getattr(self.engine, "lora_adapters", None) or {}

    def adapter_kwargs(self, model: str) -> dict:
        """``engine.generate``'s LoRA argument for a request naming ``model`` (nothing for the base)."""
        return {"lora_name": model} if model in self.lora_adapters else {}

    def check_engine(self) -> None:
        if getattr(self.engine, "errored", False):
            raise engine_error(self.engine.dead_error or EngineDeadError("the engine core is not running"))

    def decode_token(self, token_id: int, decoded: str | None) -> str:
        if self.options.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return (
            decoded if decoded is not None else self.tokenizer.decode([token_id], skip_special_tokens=False)
        )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        details = cached_tokens if self.options.enable_prompt_tokens_details else 0
        return make_usage(prompt_tokens, completion_tokens, details)

    def log_received(self, request_id: str, prompt: Any, params: Any) -> None:
        if self.options.enable_log_requests:
            text = (getattr(prompt, "text", None) or "")[:200]
            logger.info(
                "Received request %s: prompt: %r, prompt_token_ids: %d, params: %s",
                request_id,
                text,
                len(prompt.token_ids),
                params,
            )

    def token_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Any]]
    ) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
        """Per generated token: (its text, its logprob, the alternatives best first as (text, logprob)).

        Each position's dict maps token id -> Logprob(logprob, rank, decoded_token) and holds the
        sampled token and the requested top-n.
        """
        rows = []
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            chosen = entries.get(token_id)
            text = self.decode_token(token_id, getattr(chosen, "decoded_token", None))
            ranked = sorted(entries.items(), key=lambda item: -item[1].logprob)
            top = [(self.decode_token(t, lp.decoded_token), safe_logprob(lp.logprob)) for t, lp in ranked]
            rows.append((text, safe_logprob(chosen.logprob) if chosen is not None else None, top))
        return rows

    async def abort_unfinished(self, request_ids: list[str], finished: set[str]) -> None:
        for rid in request_ids:
            if rid not in finished and not getattr(self.engine, "errored", False):
                await self.engine.abort(rid)


def prompt_logprobs_field(prompt_logprobs: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first), token id -> logprob, rank and text;
    impossible tokens' -inf as MIN_LOGPROB (JSON has no infinities)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            token: PromptLogprob(
                logprob=safe_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token, lp in entries.items()
        }
        for entries in prompt_logprobs
    ]


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached_tokens} if cached_tokens else None,
    )
