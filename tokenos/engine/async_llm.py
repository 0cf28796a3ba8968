"""`AsyncLLM`: the server's frontend engine, in process 0.

Every request goes through the front door (`InputProcessor`: tokenization, the chat template,
validation, conversion), its `EngineCoreRequest`s go to the engine-core process over ZeroMQ
(`AsyncEngineCoreClient`), and the streamed `EngineCoreOutput`s come back as `RequestOutput`s with
incremental detokenization and stop strings (`OutputProcessor`). Cancelling a `generate` (client
disconnect) aborts the request in the core, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from tokenos.engine.args import EngineArgs, model_name
from tokenos.engine.core_client import (
    AsyncEngineCoreClient,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from tokenos.engine.generation_config import engine_generation_defaults
from tokenos.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from tokenos.engine.output_processor import OutputProcessor
from tokenos.engine.stat_logger import StatLogger
from tokenos.engine.tokenizer import load_tokenizer
from tokenos.outputs import RequestOutput
from tokenos.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def make_engine_core(args: EngineArgs):
    """Runs in the engine-core process (picklable by name)."""
    from tokenos.engine.core import EngineCore

    return EngineCore(args)


class AsyncLLM:
    def __init__(self, engine_args: EngineArgs, *, metrics=None) -> None:
        from tokenos.models.config import load_model_config

        self.engine_args = engine_args
        self.model_config = load_model_config(
            engine_args.model,
            dtype=engine_args.dtype,
            max_model_len=engine_args.max_model_len,
            quantization=engine_args.quantization,
            model_impl=engine_args.model_impl,
        )
        self.served_model_name = engine_args.served_model_name or model_name(self.model_config)
        # Request defaults from the model's generation config, read once for every endpoint.
        self.generation_defaults = engine_generation_defaults(self)
        self.tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_config,
            engine_args.chat_template,
            reasoning_parser=engine_args.reasoning_parser,
            structured_backend=engine_args.structured_outputs_backend,
            max_logprobs=engine_args.max_logprobs,
            logits_processors=engine_args.logits_processors,
        )
        self.metrics = metrics
        # LoRA adapters loaded in the engine core, by name (what /v1/models lists and requests may name).
        self.lora_adapters: dict[str, dict] = {}
        # Samples in flight (running or waiting in the core); beyond max_in_flight a request is refused.
        self.num_in_flight = 0
        self.max_in_flight = engine_args.max_num_seqs + engine_args.max_waiting_requests
        self.client = AsyncEngineCoreClient(
            make_engine_core,
            {"args": engine_args},
            stats_handler=metrics.update_from_engine_stats if metrics is not None else None,
            death_handler=metrics.record_engine_death if metrics is not None else None,
        )
        self.model_info = self.client.start()
        # The periodic stats line (unless disable_log_stats), from the core's latest stats.
        self.stat_logger = None
        if metrics is not None and not engine_args.disable_log_stats:
            self.stat_logger = StatLogger(metrics)
            self.stat_logger.start(lambda: self.client.latest_stats)
        if metrics is not None:  # token-count buckets span the context; vllm:cache_config_info the pool
            from tokenos.engine.metrics import cache_config_info

            max_len = self.model_info.get("max_model_len") or self.model_config.max_model_len
            metrics.configure(max_len, cache_config_info(engine_args, self.model_info))

    @property
    def errored(self) -> bool:
        return self.client.errored

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.client.dead_error

    async def check_health(self) -> None:
        await self.client.check_health()

    def shutdown(self) -> None:
        if self.stat_logger is not None:
            self.stat_logger.stop()
        self.client.shutdown()

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream `RequestOutput`s for one request (kind per `sampling_params.output_kind`).

        Checks happen NOW, before the caller starts streaming (so an HTTP handler can still answer with
        an error status): ValueError for an invalid request, `EngineOverloadedError` when more than
        `max_waiting_requests` would be waiting. While streaming, `RequestFailedError` means the engine
        failed this request alone."""
        request = self.input_processor.process(
            request_id, prompt, sampling_params, priority=priority, cache_salt=cache_salt, lora_name=lora_name
        )
        num_samples = len(request.engine_requests)
        if self.num_in_flight + num_samples > self.max_in_flight:
            if self.metrics is not None:
                self.metrics.record_rejected("queue_full")
            raise EngineOverloadedError(
                f"{self.num_in_flight} requests are in flight, the most this server queues is "
                f"{self.max_in_flight}: retry later."
            )
        return _Admitted(self, request, num_samples)

    async def _run(self, request: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        processor = OutputProcessor(self.tokenizer, self.metrics)
        processor.add_request(request)
        try:
            streams = [await self.client.add_request_async(r) for r in request.engine_requests]
            async for out in _merge(streams):
                ready, to_abort = processor.process_outputs([out])
                if to_abort:
                    await self.client.abort_requests_async(to_abort)
                for request_output in ready:
                    if request_output.error is not None:
                        raise RequestFailedError(request_output.error)
                    yield request_output
                if not processor.has_unfinished_requests():
                    return
        finally:
            leftover = processor.abort_request(request.request_id)
            if leftover and not self.client.errored:
                await self.client.abort_requests_async(leftover)

    async def abort(self, request_id: str) -> None:
        await self.client.abort_requests_async([request_id])

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def get_kv_groups(self) -> list[dict]:
        return await self.client.call_utility_async("get_kv_groups")

    async def get_stats(self) -> dict:
        return await self.client.call_utility_async("get_stats")

    async def add_lora(self, name: str, path: str) -> dict:
        """Load a LoRA adapter in the engine core; ValueError (from the core) saying what is wrong."""
        if name in self.lora_adapters or name == self.served_model_name:
            raise ValueError(
                f"a model named {name!r} is already served: unload it first, or pick another name."
            )
        try:
            info = await self.client.call_utility_async("add_lora", name, path)
        except RuntimeError as e:
            message = str(e)
            if message.startswith("ValueError: "):  # the core refused the adapter: the caller's error
                raise ValueError(message[len("ValueError: ") :]) from None
            raise
        self.lora_adapters[name] = info
        return info

    async def remove_lora(self, name: str) -> bool:
        if self.lora_adapters.pop(name, None) is None:
            return False
        return await self.client.call_utility_async("remove_lora", name)

    async def list_loras(self) -> list[dict]:
        return await self.client.call_utility_async("list_loras")


class _Admitted:
    """One admitted request's output stream. Its samples count as in flight from admission until the
    stream ends, fails, is closed, or is dropped without ever being read (then the count is given back by
    the finalizer: an HTTP handler may fail between admitting a prompt and streaming it)."""

    def __init__(self, engine: AsyncLLM, request: ProcessedRequest, num_samples: int) -> None:
        self.engine = engine
        self.num_samples = num_samples
        engine.num_in_flight += num_samples
        self._outputs = engine._run(request)
        self._released = False

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.engine.num_in_flight -= self.num_samples

    def __aiter__(self) -> _Admitted:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._outputs.__anext__()
        except BaseException:  # the end, a failure, or cancellation (client gone)
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._outputs.aclose()
        finally:
            self._release()

    def __del__(self) -> None:
        self._release()


async def _merge(streams: list[RequestStream]) -> AsyncIterator:
    """Interleave several request streams (n > 1 samples) in arrival order."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: RequestStream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as e:  # engine death or rejection reaches the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
