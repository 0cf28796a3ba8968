"""A fake engine with AsyncLLM's surface, so the HTTP layer is tested without a model.

`FakeEngine.generate` echoes the prompt: sample j of a request emits the prompt's token ids
cycled from offset j, one per output, up to max_tokens (finish "length"), honouring the
requested output kind (DELTA / FINAL_ONLY) and logprobs. The tokenizer maps one character to
one token id (its code point), so texts and ids are easy to predict.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from tokenos.engine.core_client import EngineDeadError
from tokenos.engine.input_processor import InputProcessor
from tokenos.engine.metrics import EngineMetrics
from tokenos.outputs import CompletionOutput, Logprob, RequestOutput
from tokenos.sampling_params import RequestOutputKind


class FakeTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None):
        if chat_template == "broken":
            raise ValueError("template syntax error")
        prefix = chat_template or ""
        text = prefix + "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_model_len: int = 64, step_delay_s: float = 0.0, vocab_size: int = 1000) -> None:
        self.model_config = SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab_size)
        self.served_model_name = "fake-model"
        self.tokenizer = FakeTokenizer()
        self.input_processor = InputProcessor(self.tokenizer, self.model_config)
        self.metrics = EngineMetrics("fake-model")
        self.model_info = {"kv_pool_tokens": 1024}
        self.step_delay_s = step_delay_s
        self.dead_error: EngineDeadError | None = None
        self.generate_error: Exception | None = None  # raised by generate, to test error paths
        self.calls: list[dict] = []  # every generate call's arguments
        self.aborted: list[str] = []
        self.cancelled: list[str] = []

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, prompt, sampling_params, request_id, *, priority=0, cache_salt=None):
        self.calls.append(
            dict(
                prompt=prompt,
                params=sampling_params,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
            )
        )
        if self.dead_error is not None:
            raise self.dead_error
        if self.generate_error is not None:
            raise self.generate_error
        ids = prompt.token_ids
        params = sampling_params
        samples = [SimpleNamespace(index=j, tokens=[]) for j in range(params.n)]
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_delay_s)
                for s in samples:
                    s.tokens.append(ids[(s.index + step) % len(ids)])
                done = step == params.max_tokens - 1
                if params.output_kind == RequestOutputKind.DELTA:
                    for s in samples:
                        yield self._output(request_id, ids, params, s, s.tokens[-1:], done)
                elif done:
                    yield RequestOutput(
                        request_id,
                        None,
                        ids,
                        [self._completion(params, s, s.tokens, done) for s in samples],
                        finished=True,
                    )
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    def _output(self, request_id, ids, params, sample, tokens, done) -> RequestOutput:
        completion = self._completion(params, sample, tokens, done)
        return RequestOutput(
            request_id, None, ids, [completion], finished=done, num_cached_tokens=2 if done else 0
        )

    def _completion(self, params, sample, tokens, done) -> CompletionOutput:
        logprobs = None
        if params.logprobs is not None:
            logprobs = [
                {
                    t: Logprob(-0.5, 1, None),
                    **{t + k: Logprob(-1.0 - k, k + 1, None) for k in range(1, params.logprobs + 1)},
                }
                for t in tokens
            ]
        return CompletionOutput(
            index=sample.index,
            text=self.tokenizer.decode(tokens),
            token_ids=list(tokens),
            logprobs=logprobs,
            finish_reason="length" if done else None,
        )


def serve_args(**overrides) -> argparse.Namespace:
    defaults = dict(served_model_name=None, api_key=None, chat_template=None, host="127.0.0.1", port=0)
    return argparse.Namespace(**{**defaults, **overrides})


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def fake_engine_class() -> type[FakeEngine]:
    return FakeEngine


@pytest.fixture
def slow_engine() -> FakeEngine:
    """An engine whose requests run long (a token every 50 ms, room for 100k tokens)."""
    return FakeEngine(max_model_len=100_000, step_delay_s=0.05)


@pytest.fixture
def make_client():
    """A TestClient over build_app(engine, args); closed after the test."""
    from fastapi.testclient import TestClient

    from tokenos.entrypoints.openai.api_server import build_app

    clients = []

    def make(engine: FakeEngine, **args) -> TestClient:
        client = TestClient(build_app(engine, serve_args(**args)))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server():
    """Run build_app(engine) under uvicorn in a thread on a free loopback port; yields its base URL."""
    import uvicorn

    from tokenos.entrypoints.openai.api_server import build_app

    servers = []

    def start(engine: FakeEngine, **args) -> str:
        port = free_port()
        config = uvicorn.Config(
            build_app(engine, serve_args(**args)), host="127.0.0.1", port=port, log_level="warning"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
