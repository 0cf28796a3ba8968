"""The frontend's handle on an engine core running in a child process.

`AsyncEngineCoreClient.start()` spawns the child (`core_proc.run_engine_core`), binds the sockets
and waits for READY (or raises `EngineStartupError` with the child's reason). After that, one
asyncio task reads the output socket and routes every `EngineCoreOutput` to the `RequestStream`
of its request; utility results resolve their futures; per-step stats go to `stats_handler`.

Engine death is detected in that task: the child process exited, the core reported a crash, or
the output socket has been silent (no outputs, no heartbeat) for `silence_timeout_s`. Then every
in-flight stream and utility call fails with `EngineDeadError`, later calls fail at once, and
`errored` / `dead_error` say so (the server turns that into 503s and a non-zero exit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenos.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenos.engine import core_proc
from tokenos.engine.core_proc import CoreAddresses, Handshake, RequestRejected, UtilityCall, UtilityResult

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core process is gone or wedged; no request can complete. Restart the server."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (bad model path, KV pool too small, ...); the message says why."""


class RequestRejectedError(ValueError):
    """The engine core refused one request (`add_request` raised ValueError); the rest keep going."""


class RequestFailedError(RuntimeError):
    """The engine failed one request alone (e.g. its sampling raised); every other request goes on."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are already in flight (`max_waiting_requests`): come back later."""


class RequestStream:
    """Async iterator over one request's `EngineCoreOutput`s; ends after the finished one.

    Raises `EngineDeadError` if the engine dies, `RequestRejectedError` if the core refused the request.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._done = False

    def put(self, item: EngineCoreOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item


class AsyncEngineCoreClient:
    """Starts an engine core process and talks to it over ZeroMQ from an asyncio frontend."""

    def __init__(
        self,
        engine_factory: Callable[..., Any],
        factory_kwargs: dict | None = None,
        *,
        startup_timeout_s: float = 600.0,
        heartbeat_interval_s: float = 1.0,
        silence_timeout_s: float | None = 120.0,
        stats_handler: Callable[[dict], None] | None = None,
        death_handler: Callable[[], None] | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.factory_kwargs = dict(factory_kwargs or {})
        self.startup_timeout_s = startup_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.silence_timeout_s = silence_timeout_s
        self.stats_handler = stats_handler
        self.death_handler = death_handler
        self.model_info: dict = {}
        self.latest_stats: dict = {}
        self.dead_error: EngineDeadError | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._streams: dict[str, RequestStream] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._last_recv = time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()

    # ------------------------------------------------------------------ life cycle

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def start(self) -> dict:
        """Spawn the engine core and block until it is READY; returns its model info."""
        self._tmpdir = tempfile.mkdtemp(prefix="tokenos-core-")
        addresses = CoreAddresses(self._tmpdir)
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(addresses.input)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(addresses.output)
        handshake_ctx = zmq.Context()
        handshake = handshake_ctx.socket(zmq.PULL)
        handshake.bind(addresses.handshake)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=core_proc.run_engine_core,
            args=(self.engine_factory, self.factory_kwargs, addresses, self.heartbeat_interval_s),
            name="tokenos-engine-core",
            daemon=True,
        )
        self.proc.start()
        try:
            self.model_info = self._wait_for_ready(handshake)
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)
            handshake_ctx.term()
        self._last_recv = time.monotonic()
        return self.model_info

    def _wait_for_ready(self, handshake: zmq.Socket) -> dict:
        deadline = time.monotonic() + self.startup_timeout_s
        while not handshake.poll(timeout=100):
            if not self.proc.is_alive():
                raise EngineStartupError(
                    f"engine core process exited during start-up (exit code {self.proc.exitcode}); "
                    "see its log above"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core did not become ready within {self.startup_timeout_s}s")
        msg = msgspec.msgpack.decode(handshake.recv(), type=Handshake)
        if not msg.ready:
            raise EngineStartupError(f"engine core failed to start: {msg.error}")
        return msg.model_info or {}

    def shutdown(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL) and release sockets; in-flight requests fail."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self._fail_all(EngineDeadError("engine core was shut down"))
        for sock in (self._input, self._output):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ requests

    async def add_request_async(self, request: EngineCoreRequest) -> RequestStream:
        """Send one request; its outputs arrive on the returned stream."""
        self._ensure_running()
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight; ids must be unique")
        stream = RequestStream(request.request_id)
        self._streams[request.request_id] = stream  # before sending: the first output may be quick
        await self._send(core_proc.ADD, request)
        return stream

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort in the core; each stream still open ends with a finished ABORT output."""
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(EngineCoreOutput(rid, [], finish_reason=int(FinishReason.ABORT)))
        if self.dead_error is None and request_ids:
            self._ensure_running()
            await self._send(core_proc.ABORT, list(request_ids))

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        """Call `core.<name>(*args)` in the engine core process and return its result."""
        self._ensure_running()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        await self._send(core_proc.UTILITY, UtilityCall(call_id, name, list(args)))
        return await future

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine core is dead."""
        self._ensure_running()

    def _ensure_running(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._ctx is None:
            raise RuntimeError("AsyncEngineCoreClient.start() must be called first")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs(), name="core-outputs")

    async def _send(self, kind: bytes, msg: Any) -> None:
        await self._input.send_multipart([kind, self._encoder.encode(msg)], copy=False)

    # ------------------------------------------------------------------ the output task

    async def _read_outputs(self) -> None:
        decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        decode_utility = msgspec.msgpack.Decoder(UtilityResult).decode
        decode_rejected = msgspec.msgpack.Decoder(RequestRejected).decode
        poll_ms = int(min(self.heartbeat_interval_s, 0.5) * 1000)
        try:
            while True:
                if not await self._output.poll(timeout=poll_ms):
                    self._check_alive()
                    continue
                kind, payload = await self._output.recv_multipart()
                self._last_recv = time.monotonic()
                if kind == core_proc.OUTPUTS:
                    self._dispatch_outputs(decode_outputs(payload))
                elif kind == core_proc.UTILITY:
                    self._resolve_utility(decode_utility(payload))
                elif kind == core_proc.REJECTED:
                    rejected = decode_rejected(payload)
                    stream = self._streams.pop(rejected.request_id, None)
                    if stream is not None:
                        stream.put(RequestRejectedError(rejected.message))
                elif kind == core_proc.DEAD:
                    raise EngineDeadError(f"engine core crashed: {msgspec.msgpack.decode(payload)}")
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._die(e)
        except Exception as e:  # a bug in this loop must not leave requests hanging forever
            logger.exception("engine core output loop failed")
            self._die(EngineDeadError(f"engine core output loop failed: {type(e).__name__}: {e}"))

    def _check_alive(self) -> None:
        if not self.proc.is_alive():
            raise EngineDeadError(f"engine core process exited unexpectedly (exit code {self.proc.exitcode})")
        silence = time.monotonic() - self._last_recv
        if self.silence_timeout_s is not None and silence > self.silence_timeout_s:
            raise EngineDeadError(f"engine core sent nothing for {silence:.0f}s (no heartbeat); it is wedged")

    def _dispatch_outputs(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            # Outputs of a request aborted here (stream already gone) are dropped.
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        if outputs.stats:
            self.latest_stats = outputs.stats
            if self.stats_handler is not None:
                self.stats_handler(outputs.stats)

    def _resolve_utility(self, result: UtilityResult) -> None:
        future = self._utility_futures.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    def _die(self, error: EngineDeadError) -> None:
        logger.error("%s", error)
        self.dead_error = error
        if self.death_handler is not None:
            self.death_handler()
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()  # a wedged core must not keep holding the model's memory
        self._fail_all(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        if self.dead_error is None:
            self.dead_error = error
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
        self._utility_futures.clear()
