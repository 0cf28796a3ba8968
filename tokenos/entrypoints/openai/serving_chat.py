"""POST /v1/chat/completions: messages (and tools) -> chat template -> one prompt, n samples.

The front door renders the conversation (`InputProcessor.render_chat`): the request's
`chat_template`, else the server's `--chat-template`, else the tokenizer's own; the rendered text is
tokenized without adding special tokens (the template writes its own BOS). Tools reach the template
(a template that does not read them is refused unless tool_choice is "none"). Each choice's text is
read by a `ChoiceReader`: reasoning (``--reasoning-parser``), then tool calls (`tool_choice`: "auto"
through ``--tool-call-parser``, "required" and named functions forced by a grammar). Streaming sends,
per choice, a first chunk with the assistant role, then reasoning / content / tool-call deltas, then
one with the finish reason ("tool_calls" when the model called tools); usage comes last when asked for.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any

from tokenos.engine.input_processor import Prompt
from tokenos.entrypoints.openai.chat_output import ChoiceDelta, ChoiceReader, tool_call_id
from tokenos.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    OpenAIError,
    TokenizeRequest,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    random_id,
)
from tokenos.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    SSE_DONE,
    ClientDisconnected,
    OpenAIServing,
    ServingOptions,
    engine_error,
    make_usage,
    merge_outputs,
    prompt_logprobs_field,
    sse,
)
from tokenos.entrypoints.openai.tool_choice import is_forced, template_renders_tools
from tokenos.reasoning import ReasoningState
from tokenos.sampling_params import SamplingParams
from tokenos.tool_parsers import NamedToolParser, RequiredToolsParser, ToolParser, get_tool_parser


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        executor: Executor | None = None,
        tool_call_parser: str | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        """``tool_call_parser`` (with ``--enable-auto-tool-choice``) reads tool_choice "auto" calls."""
        super().__init__(engine, served_model_names, executor, options)
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None

    def render_prompt(
        self, request: ChatCompletionRequest | TokenizeRequest, tools: list[dict[str, Any]] | None = None
    ) -> Prompt:
        """The templated conversation (text and ids); 400 when the template cannot render it."""
        kwargs = dict(request.chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        if getattr(request, "continue_final_message", False):
            if request.add_generation_prompt:
                raise OpenAIError(
                    "continue_final_message continues the last message: set add_generation_prompt to false.",
                    param="continue_final_message",
                )
            kwargs["continue_final_message"] = True
        return self.input_processor.render_chat(
            request.template_messages(),
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            **kwargs,
        )

    def _prepare_prompt(self, request: ChatCompletionRequest, params: SamplingParams) -> Prompt:
        """The rendered, tokenized, truncated (truncate_prompt_tokens), checked conversation (in a worker
        thread)."""
        tools = request.tool_dicts()
        if tools and request.resolved_tool_choice() != "none":
            template = self.input_processor.active_chat_template(request.chat_template)
            if not template_renders_tools(template):
                raise OpenAIError(
                    "The chat template does not render tools, so the model would never see them. Start "
                    "the server with --chat-template FILE (tokenos ships `--chat-template chatml_tools` "
                    "for ChatML models) or send chat_template with the request.",
                    param="tools",
                )
        prompt = self.input_processor.truncate(self.render_prompt(request, tools), params)
        self.input_processor.check_prompt(prompt.token_ids, "messages")
        self.input_processor.check_context(len(prompt.token_ids), params.max_tokens)
        return prompt

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=true) an iterator of SSE lines; raises OpenAIError."""
        model = self.check_model(request.model)
        self.check_engine()
        request = self.with_defaults(request)
        params = request.to_sampling_params(self.input_processor.structured_backend)
        tool_parser = self._tool_parser(request)
        self.input_processor.check_params(params)
        prompt = await self.off_loop(self._prepare_prompt, request, params)
        request_id = random_id("chatcmpl")
        try:  # admission happens here, before any byte of the response: refusals keep their status
            generator = self.engine.generate(
                prompt,
                params,
                request_id,
                priority=request.priority,
                cache_salt=request.cache_salt,
                **self.adapter_kwargs(model),
            )
        except Exception as e:
            raise engine_error(e) from e
        is_disconnected = raw_request.is_disconnected if raw_request is not None else None
        run = _ChatRun(request_id, model, request, len(prompt.token_ids))
        run.show_cached = self.options.enable_prompt_tokens_details
        self.log_received(request_id, prompt, params)
        reasoning = self.input_processor.reasoning_parser
        state = reasoning.initial_state(prompt.text) if reasoning is not None else ReasoningState.ENDED
        max_calls = None if request.parallel_tool_calls else 1
        run.new_reader = lambda: ChoiceReader(reasoning, state, tool_parser, max_calls)
        if request.stream:
            return self._stream(run, generator, is_disconnected)
        return await self._complete(run, generator, is_disconnected)

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        """The parser reading this request's tool calls (None: plain text); 400 for "auto" on a server
        started without ``--enable-auto-tool-choice --tool-call-parser``."""
        choice = request.resolved_tool_choice()
        if choice in (None, "none"):
            return None
        tools = request.tool_dicts()
        if choice == "required":
            return RequiredToolsParser(tools)
        if is_forced(choice):
            return NamedToolParser(tools, function_name=choice)
        if self.tool_parser_cls is None:
            raise OpenAIError(
                '"auto" tool choice (the default with tools) requires the server to be started with '
                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "required", '
                '"none" or a named function.',
                param="tool_choice" if request.tool_choice is not None else "tools",
            )
        return self.tool_parser_cls(tools)

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
            read = run.new_reader().read(sample.text)
            calls = [
                ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in read.calls
            ]
            message = AssistantMessage(
                role=self.options.response_role,
                content=read.content,
                reasoning_content=read.reasoning if run.request.include_reasoning else None,
                tool_calls=calls,
            )
            choices.append(
                ChatChoice(
                    index=sample.index,
                    message=message,
                    logprobs=self._logprobs(run, sample),
                    finish_reason=run.finish_reason(sample.finish_reason, bool(calls)),
                    stop_reason=sample.stop_reason,
                )
            )
            run.completion_tokens += len(sample.token_ids)
        run.cached_tokens = final.num_cached_tokens
        prompt_logprobs = None
        if run.request.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_field(final.prompt_logprobs)
        return ChatCompletionResponse(
            id=run.id,
            created=run.created,
            model=run.model,
            choices=choices,
            usage=run.usage(),
            prompt_logprobs=prompt_logprobs,
        )

    async def _stream(self, run: _ChatRun, generator: Any, is_disconnected) -> AsyncIterator[str]:
        started: set[int] = set()
        finished = False
        sent_prompt_logprobs = False
        try:
            async for _, out in merge_outputs([generator], is_disconnected):
                for sample in out.outputs:
                    if sample.index not in started:
                        started.add(sample.index)
                        yield sse(
                            run.chunk(
                                ChatStreamChoice(
                                    index=sample.index,
                                    delta=DeltaMessage(role=self.options.response_role, content=""),
                                )
                            )
                        )
                    run.completion_tokens += len(sample.token_ids)
                    done = sample.finish_reason is not None
                    delta = run.reader(sample.index).feed(sample.text or "", final=done)
                    logprobs = self._logprobs(run, sample)
                    if not delta and not done and logprobs is None:
                        continue
                    choice = ChatStreamChoice(
                        index=sample.index,
                        delta=run.delta_message(sample.index, delta),
                        logprobs=logprobs,
                        finish_reason=run.finish_reason(sample.finish_reason, run.called(sample.index))
                        if done
                        else None,
                        stop_reason=sample.stop_reason,
                    )
                    chunk = run.chunk(choice)
                    if (
                        run.request.prompt_logprobs is not None
                        and not sent_prompt_logprobs
                        and sample.token_ids
                    ):
                        sent_prompt_logprobs = True  # the prompt is all scored once a token is out
                        chunk.prompt_logprobs = prompt_logprobs_field(out.prompt_logprobs)
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
        self.show_cached = False
        self.new_reader: Callable[[], ChoiceReader] = lambda: ChoiceReader(None, ReasoningState.ENDED, None)
        self._readers: dict[int, ChoiceReader] = {}
        self._call_ids: dict[int, dict[int, str]] = {}  # choice -> call index -> its id

    def reader(self, index: int) -> ChoiceReader:
        if index not in self._readers:
            self._readers[index] = self.new_reader()
        return self._readers[index]

    def called(self, index: int) -> bool:
        return bool(self._call_ids.get(index))

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" for a choice that ended by calling tools (OpenAI keeps "stop" when one function
        was forced by name)."""
        forced_by_name = isinstance(self.request.tool_choice, NamedToolChoice)
        return "tool_calls" if reason == "stop" and called and not forced_by_name else reason

    def delta_message(self, index: int, delta: ChoiceDelta) -> DeltaMessage:
        ids = self._call_ids.setdefault(index, {})
        calls = []
        for call in delta.calls:
            first = call.index not in ids
            if first:
                ids[call.index] = tool_call_id()
            calls.append(
                DeltaToolCall(
                    index=call.index,
                    id=ids[call.index] if first else None,
                    type="function" if first else None,
                    function=DeltaFunctionCall(name=call.name if first else None, arguments=call.arguments),
                )
            )
        reasoning = delta.reasoning if self.request.include_reasoning else ""
        return DeltaMessage(
            content=delta.content or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )

    def chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage(self):
        cached = self.cached_tokens if self.show_cached else 0  # --enable-prompt-tokens-details
        return make_usage(self.prompt_tokens, self.completion_tokens, cached)
