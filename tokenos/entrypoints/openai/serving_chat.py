"""POST /v1/chat/completions: messages -> chat template -> one prompt, n samples.

The front door renders the conversation (`InputProcessor.render_chat`): the request's
`chat_template`, else the server's `--chat-template`, else the tokenizer's own; the rendered text is
tokenized without adding special tokens (the template writes its own BOS). Streaming sends, per choice,
a first chunk with the assistant role, then content deltas, then one with the finish reason; usage
comes last when asked for.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tokenos.engine.input_processor import Prompt
from tokenos.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    OpenAIError,
    TokenizeRequest,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from tokenos.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    engine_error,
    make_usage,
    merge_outputs,
    sse,
)


class OpenAIServingChat(OpenAIServing):
    def render_prompt(self, request: ChatCompletionRequest | TokenizeRequest) -> Prompt:
        """The templated conversation (text and ids); 400 when the template cannot render it."""
        return self.input_processor.render_chat(
            request.template_messages(),
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            **(request.chat_template_kwargs or {}),
        )

    def _prepare_prompt(self, request: ChatCompletionRequest, max_tokens: int | None) -> Prompt:
        """The rendered, tokenized, checked conversation (in a worker thread)."""
        prompt = self.render_prompt(request)
        self.input_processor.check_prompt(prompt.token_ids, "messages")
        self.input_processor.check_context(len(prompt.token_ids), max_tokens)
        return prompt

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=true) an iterator of SSE lines; raises OpenAIError."""
        model = self.check_model(request.model)
        self.check_engine()
        params = request.to_sampling_params()
        self.input_processor.check_params(params)
        prompt = await self.off_loop(self._prepare_prompt, request, params.max_tokens)
        request_id = random_id("chatcmpl")
        try:  # admission happens here, before any byte of the response: refusals keep their status
            generator = self.engine.generate(
                prompt, params, request_id, priority=request.priority, cache_salt=request.cache_salt
            )
        except Exception as e:
            raise engine_error(e) from e
        is_disconnected = raw_request.is_disconnected if raw_request is not None else None
        run = _ChatRun(request_id, model, request, len(prompt.token_ids))
        if request.stream:
            return self._stream(run, generator, is_disconnected)
        return await self._complete(run, generator, is_disconnected)

    async def _complete(self, run: _ChatRun, generator: Any, is_disconnected) -> ChatCompletionResponse:
        final = None
        try:
            async for _, out in merge_outputs([generator], is_disconnected):
                final = out
        except ClientDisconnected:
            raise
        except Exception as e:
            raise engine_error(e) from e
        finally:
            await self.abort_unfinished([run.id], {run.id} if final is not None and final.finished else set())
        if final is None:
            raise OpenAIError("The engine ended the request without an output.", status=500)
        choices = []
        for sample in sorted(final.outputs, key=lambda s: s.index):
            choices.append(
                ChatChoice(
                    index=sample.index,
                    message=AssistantMessage(content=sample.text),
                    logprobs=self._logprobs(run, sample),
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
            run.completion_tokens += len(sample.token_ids)
        run.cached_tokens = final.num_cached_tokens
        return ChatCompletionResponse(
            id=run.id, created=run.created, model=run.model, choices=choices, usage=run.usage()
        )

    async def _stream(self, run: _ChatRun, generator: Any, is_disconnected) -> AsyncIterator[str]:
        started: set[int] = set()
        finished = False
        try:
            async for _, out in merge_outputs([generator], is_disconnected):
                for sample in out.outputs:
                    if sample.index not in started:
                        started.add(sample.index)
                        yield sse(
                            run.chunk(
                                ChatStreamChoice(
                                    index=sample.index, delta=DeltaMessage(role="assistant", content="")
                                )
                            )
                        )
                    run.completion_tokens += len(sample.token_ids)
                    if not sample.text and sample.finish_reason is None:
                        continue
                    choice = ChatStreamChoice(
                        index=sample.index,
                        delta=DeltaMessage(content=sample.text or None),
                        logprobs=self._logprobs(run, sample),
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                    )
                    chunk = run.chunk(choice)
                    if run.request.stream_options and run.request.stream_options.continuous_usage_stats:
                        chunk.usage = run.usage()
                    yield sse(chunk)
                finished = out.finished
                run.cached_tokens = out.num_cached_tokens
            if run.request.include_usage:
                yield sse(
                    ChatCompletionChunk(
                        id=run.id, created=run.created, model=run.model, choices=[], usage=run.usage()
                    )
                )
        except ClientDisconnected:
            return
        except Exception as e:
            yield sse(engine_error(e).to_response())
        finally:
            await self.abort_unfinished([run.id], {run.id} if finished else set())
        yield SSE_DONE

    def _logprobs(self, run: _ChatRun, sample: Any) -> ChatLogprobs | None:
        if not run.request.logprobs or sample.logprobs is None:
            return None
        k = run.request.top_logprobs or 0
        content = [
            TokenLogprob(
                token=token,
                logprob=logprob if logprob is not None else MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in top[:k]],
            )
            for token, logprob, top in self.token_logprobs(sample.token_ids, sample.logprobs)
        ]
        return ChatLogprobs(content=content)


class _ChatRun:
    """The state of one chat completion across its chunks."""

    def __init__(
        self, request_id: str, model: str, request: ChatCompletionRequest, prompt_tokens: int
    ) -> None:
        self.id = request_id
        self.model = model
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.completion_tokens = 0
        self.cached_tokens = 0

    def chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage(self):
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
