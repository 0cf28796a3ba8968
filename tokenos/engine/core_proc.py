"""The engine core in its own process: a busy loop between two ZeroMQ sockets.

The frontend (process 0) tokenizes, detokenizes and speaks HTTP; the engine core (this process)
only schedules and runs steps, so slow Python on one side never stalls the other. The child
builds its engine core from a picklable `(factory, kwargs)`, reports READY (with the model info)
or the start-up error on a handshake socket, then loops:

    drain input (block only when there is no work)  ->  outputs = core.step()  ->  send outputs

Wire protocol (every message is a two-frame multipart: one kind byte, one msgpack payload):
frontend -> core on `input`: ADD (EngineCoreRequest), ABORT (list of ids), UTILITY (UtilityCall);
core -> frontend on `output`: OUTPUTS (EngineCoreOutputs), UTILITY (UtilityResult),
REJECTED (RequestRejected: `add_request` raised ValueError; that request is over), DEAD (the
loop crashed: why), HEARTBEAT (idle and alive). The parent binds every socket (ipc:// in a
private temp dir); the child connects. The child exits on SIGTERM and when its parent process is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from tokenos.core.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

# Frame 0 of every message.
ADD = b"A"
ABORT = b"B"
UTILITY = b"U"
OUTPUTS = b"O"
REJECTED = b"R"
DEAD = b"D"
HEARTBEAT = b"H"


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    name: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class RequestRejected(msgspec.Struct, array_like=True):
    request_id: str
    message: str


class Handshake(msgspec.Struct, array_like=True, omit_defaults=True):
    ready: bool
    model_info: dict | None = None
    error: str | None = None


class EngineCoreLike(Protocol):
    """What the busy loop needs from an engine core (tokenos.engine.core.EngineCore)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def step(self) -> EngineCoreOutputs: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> dict: ...
    def get_model_info(self) -> dict: ...


@dataclass(frozen=True)
class CoreAddresses:
    """The three ipc endpoints of one engine core, all in `directory`."""

    directory: str

    @property
    def input(self) -> str:
        return f"ipc://{self.directory}/input"

    @property
    def output(self) -> str:
        return f"ipc://{self.directory}/output"

    @property
    def handshake(self) -> str:
        return f"ipc://{self.directory}/handshake"


class _Shutdown(BaseException):
    """Raised in the child's main thread by SIGTERM (or parent death) to leave the loop."""


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _Shutdown()


def _exit_when_parent_dies() -> None:
    # spawn gives the child a pipe whose other end only the parent holds: EOF means it is gone.
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(
    engine_factory: Callable[..., EngineCoreLike],
    factory_kwargs: dict,
    addresses: CoreAddresses,
    heartbeat_interval_s: float = 1.0,
) -> None:
    """Child-process entry point: build the core, hand-shake, run the busy loop until told to stop."""
    if not logging.getLogger().handlers:  # a spawned child starts with no logging set up
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which shuts us down
    _exit_when_parent_dies()
    ctx = zmq.Context()
    proc: EngineCoreProc | None = None
    try:
        core, model_info = _build_core(ctx, engine_factory, factory_kwargs, addresses)
        if core is None:
            raise SystemExit(1)
        proc = EngineCoreProc(core, ctx, addresses, heartbeat_interval_s)
        _send_handshake(ctx, addresses, Handshake(ready=True, model_info=model_info))
        proc.run_busy_loop()
    except _Shutdown:
        logger.info("engine core shutting down")
    finally:
        if proc is not None:
            proc.close()
        ctx.destroy(linger=0)


def _build_core(
    ctx: zmq.Context, engine_factory: Callable[..., EngineCoreLike], kwargs: dict, addresses: CoreAddresses
) -> tuple[EngineCoreLike | None, dict]:
    try:
        core = engine_factory(**kwargs)
        return core, core.get_model_info()
    except _Shutdown:
        raise
    except BaseException as e:  # noqa: BLE001 - any start-up failure is reported, not crashed on
        logger.error("engine core failed to start:\n%s", traceback.format_exc())
        _send_handshake(ctx, addresses, Handshake(ready=False, error=f"{type(e).__name__}: {e}"))
        return None, {}


def _send_handshake(ctx: zmq.Context, addresses: CoreAddresses, msg: Handshake) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)  # make sure READY / the error reaches the parent before we go on
    sock.connect(addresses.handshake)
    sock.send(msgspec.msgpack.encode(msg))
    sock.close()


class EngineCoreProc:
    """Owns the core's sockets and runs its busy loop (in the child process)."""

    def __init__(
        self, core: EngineCoreLike, ctx: zmq.Context, addresses: CoreAddresses, heartbeat_interval_s: float
    ) -> None:
        self.core = core
        self.heartbeat_interval_s = heartbeat_interval_s
        self.input = ctx.socket(zmq.PULL)
        self.input.connect(addresses.input)
        self.output = ctx.socket(zmq.PUSH)
        self.output.connect(addresses.output)
        self._encoder = msgspec.msgpack.Encoder()
        self._decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
        self._decode_ids = msgspec.msgpack.Decoder(list[str]).decode
        self._decode_utility = msgspec.msgpack.Decoder(UtilityCall).decode
        self._last_send = time.monotonic()

    def run_busy_loop(self) -> None:
        busy = False
        try:
            while True:
                self._process_input(block=not busy)
                was_busy, busy = busy, self.core.has_unfinished_requests()
                if busy:
                    outputs = self.core.step()
                    if outputs.outputs or outputs.stats:
                        self._send(OUTPUTS, outputs)
                elif was_busy:
                    # Gone idle (e.g. the last request was aborted): no step will report that, so send
                    # the stats now, or the frontend's gauges would show the last busy step forever.
                    self._send(OUTPUTS, EngineCoreOutputs(timestamp=time.time(), stats=self.core.get_stats()))
                self._maybe_heartbeat()
        except _Shutdown:
            raise
        except Exception as e:
            # The core is in an unknown state: tell the frontend why, then die (it fails every request).
            logger.error("engine core crashed:\n%s", traceback.format_exc())
            self._send(DEAD, f"{type(e).__name__}: {e}")
            raise SystemExit(1) from e

    def _process_input(self, block: bool) -> None:
        if block and not self.input.poll(timeout=int(self.heartbeat_interval_s * 1000)):
            return
        while True:
            try:
                kind, payload = self.input.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(kind, payload)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ADD:
            self._add_request(self._decode_request(payload))
        elif kind == ABORT:
            self.core.abort_requests(self._decode_ids(payload))
        elif kind == UTILITY:
            self._send(UTILITY, self._call_utility(self._decode_utility(payload)))
        else:
            logger.error("engine core: unknown message kind %r ignored", kind)

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as e:
            # A bad request fails alone: its stream gets the reason, the engine keeps serving.
            self._send(REJECTED, RequestRejected(request.request_id, str(e)))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        method = None if call.name.startswith("_") else getattr(self.core, call.name, None)
        if not callable(method):
            return UtilityResult(call.call_id, error=f"engine core has no utility {call.name!r}")
        try:
            result = method(*call.args)
            self._encoder.encode(result)  # fail here, not in _send, when the result cannot cross
            return UtilityResult(call.call_id, result=result)
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _send(self, kind: bytes, msg: Any) -> None:
        self.output.send_multipart([kind, self._encoder.encode(msg)], copy=False)
        self._last_send = time.monotonic()

    def _maybe_heartbeat(self) -> None:
        if time.monotonic() - self._last_send >= self.heartbeat_interval_s:
            self._send(HEARTBEAT, None)

    def close(self) -> None:
        shutdown = getattr(self.core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.input.close(linger=0)
        self.output.close(linger=0)
