"""POST /v1/completions: one or several prompts (text or token ids), n samples each.

Prompt `i`'s sample `j` is choice `i * n + j`, as in OpenAI's API. Prompts are tokenized and
checked by the front door before anything is generated, so a prompt that cannot fit fails with 400
before anything reaches the engine; the engine gets the tokenized prompts. Non-streaming requests ask the
engine for final outputs only; streaming ones for deltas, sent as SSE chunks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenos.engine.input_processor import Prompt
from tokenos.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    random_id,
)
from tokenos.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    engine_error,
    make_usage,
    merge_outputs,
    prompt_logprobs_field,
    sse,
)
from tokenos.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: Any = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or (stream=true) an iterator of SSE lines; raises OpenAIError."""
        model = self.check_model(request.model)
        self.check_engine()
        request = self.with_defaults(request)
        params = request.to_sampling_params(self.input_processor.structured_backend)
        self.input_processor.check_params(params)
        prompts = await self.off_loop(self._prepare_prompts, request, params)
        base_id = random_id("cmpl")
        run = _Run(base_id, model, request, prompts, params.n)
        run.show_cached = self.options.enable_prompt_tokens_details
        for prompt, rid in zip(prompts, run.request_ids, strict=True):
            self.log_received(rid, prompt, params)
        try:  # admission happens here, before any byte of the response: refusals keep their status
            generators = [
                self.engine.generate(
                    prompt,
                    params,
                    rid,
                    priority=request.priority,
                    cache_salt=request.cache_salt,
                    **self.adapter_kwargs(model),
                )
                for prompt, rid in zip(prompts, run.request_ids, strict=True)
            ]
        except Exception as e:
            raise engine_error(e) from e
        is_disconnected = raw_request.is_disconnected if raw_request is not None else None
        if request.stream:
            return self._stream(run, generators, is_disconnected)
        return await self._complete(run, generators, is_disconnected)

    def _prepare_prompts(self, request: CompletionRequest, params: SamplingParams) -> list[Prompt]:
        """Every prompt tokenized and checked (in a worker thread: prompts may be large)."""
        door = self.input_processor
        prompts = [door.truncate(self._tokenize(p, request.echo), params) for p in request.prompts()]
        for prompt in prompts:
            door.check_prompt(prompt.token_ids)
            door.check_context(len(prompt.token_ids), params.max_tokens)
        return prompts

    def _tokenize(self, prompt: str | list[int], echo: bool) -> Prompt:
        """Text is encoded; token ids are kept, and decoded (ids checked first) when echoed."""
        door = self.input_processor
        if isinstance(prompt, str):
            return door.tokenize_prompt(prompt)
        return Prompt(list(prompt), door.decode(list(prompt), param="prompt") if echo else None)

    async def _complete(self, run: _Run, generators: list, is_disconnected) -> CompletionResponse:
        finals: dict[int, Any] = {}
        try:
            async for i, out in merge_outputs(generators, is_disconnected):
                finals[i] = out
                if out.finished:
                    run.finished.add(run.request_ids[i])
        except ClientDisconnected:
            raise
        except Exception as e:
            raise engine_error(e) from e
        finally:
            await self.abort_unfinished(run.request_ids, run.finished)
        if len(finals) < len(generators):
            raise OpenAIError("The engine ended a request without an output.", status=500)
        choices = []
        for i, out in sorted(finals.items()):
            for sample in out.outputs:
                sample = run.shown(sample)
                text = run.prompt_text(i) + sample.text if run.request.echo else sample.text
                choices.append(self._choice(run, i, sample, text, out, first=True))
                run.completion_tokens += len(sample.token_ids)
            run.cached_tokens += out.num_cached_tokens
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=run.id, created=run.created, model=run.model, choices=choices, usage=run.usage()
        )

    async def _stream(self, run: _Run, generators: list, is_disconnected) -> AsyncIterator[str]:
        started: set[int] = set()  # choices whose first token has been sent
        try:
            async for i, out in merge_outputs(generators, is_disconnected):
                for sample in out.outputs:
                    sample = run.shown(sample)
                    index = i * run.n + sample.index
                    text = sample.text
                    # The prompt (echo, its logprobs) goes with the first token: by then it is all scored.
                    first = index not in started and bool(sample.token_ids or sample.finish_reason)
                    if first:
                        started.add(index)
                        if run.request.echo:
                            text = run.prompt_text(i) + text
                    run.completion_tokens += len(sample.token_ids)
                    if not text and not sample.token_ids and sample.finish_reason is None:
                        continue
                    chunk = CompletionResponse(
                        id=run.id,
                        created=run.created,
                        model=run.model,
                        choices=[self._choice(run, i, sample, text, out, first=first)],
                    )
                    if run.request.stream_options and run.request.stream_options.continuous_usage_stats:
                        chunk.usage = run.usage()
                    yield sse(chunk)
                if out.finished:
                    run.finished.add(run.request_ids[i])
                    run.cached_tokens += out.num_cached_tokens
            if run.request.include_usage:
                yield sse(
                    CompletionResponse(
                        id=run.id, created=run.created, model=run.model, choices=[], usage=run.usage()
                    )
                )
        except ClientDisconnected:
            return
        except Exception as e:
            yield sse(engine_error(e).to_response())
        finally:
            await self.abort_unfinished(run.request_ids, run.finished)
        yield SSE_DONE

    def _choice(self, run: _Run, i: int, sample: Any, text: str, out: Any, first: bool) -> CompletionChoice:
        """Choice ``i * n + sample.index``; the ``first`` chunk of a choice carries its prompt's scores: with
        echo and logprobs the prompt tokens' logprobs (the first None: it has no context) lead the
        logprobs, and with prompt_logprobs vLLM's field."""
        logprobs = None
        if run.request.logprobs is not None and sample.logprobs is not None:
            rows = self.prompt_logprob_rows(out) if run.request.echo and first else []
            rows += self.token_logprobs(sample.token_ids, sample.logprobs)
            logprobs = CompletionLogprobs()
            offset = run.text_offsets.get((i, sample.index), 0)
            for token, logprob, top in rows:
                logprobs.tokens.append(token)
                logprobs.token_logprobs.append(logprob)
                logprobs.top_logprobs.append(dict(top) if top is not None else None)
                logprobs.text_offset.append(offset)
                offset += len(token)
            run.text_offsets[(i, sample.index)] = offset
        prompt_logprobs = None
        if run.request.prompt_logprobs is not None and first:
            prompt_logprobs = prompt_logprobs_field(out.prompt_logprobs)
        return CompletionChoice(
            index=i * run.n + sample.index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def prompt_logprob_rows(self, out: Any) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
        """The echoed prompt's rows for completion logprobs: (text, logprob, alternatives) per token."""
        ids = list(out.prompt_token_ids or [])
        scored = list(out.prompt_logprobs or [])
        rows: list = []
        for position, token_id in enumerate(ids):
            entries = scored[position] if position < len(scored) else None
            if entries is None:
                rows.append((self.decode_token(token_id, None), None, None))
            else:
                rows.extend(self.token_logprobs([token_id], [entries]))
        return rows


class _Run:
    """The state of one /v1/completions request across its prompts and chunks."""

    def __init__(
        self,
        base_id: str,
        model: str,
        request: CompletionRequest,
        prompts: list[Prompt],
        n: int,
    ) -> None:
        self.id = base_id
        self.model = model
        self.request = request
        self.prompts = prompts
        self.n = n
        self.created = int(time.time())
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.finished: set[str] = set()
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.text_offsets: dict[tuple[int, int], int] = {}
        self.show_cached = False

    def prompt_text(self, i: int) -> str:
        return self.prompts[i].text or ""

    def shown(self, sample: Any) -> Any:
        """The sample as the client sees it: with max_tokens 0 the one token run for it is dropped."""
        if self.request.max_tokens != 0:
            return sample
        return dataclasses.replace(
            sample, text="", token_ids=[], logprobs=[] if sample.logprobs is not None else None
        )

    def usage(self):
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        cached = self.cached_tokens if self.show_cached else 0  # --enable-prompt-tokens-details
        return make_usage(prompt_tokens, self.completion_tokens, cached)
