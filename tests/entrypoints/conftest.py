"""Fixtures of the HTTP-layer tests: the fake engine (tests.fixtures.fakes.FakeEngine, AsyncLLM's surface
without a model) and TestClients over the app built on it."""

from __future__ import annotations

import pytest

from tests.fixtures.fakes import FakeEngine
from tests.fixtures.servers import app_client


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def slow_engine() -> FakeEngine:
    """An engine whose requests run long (a token every 50 ms, room for 100k tokens)."""
    return FakeEngine(max_model_len=100_000, step_delay_s=0.05)


@pytest.fixture
def make_client():
    """``make(engine, **server args)``: a TestClient over build_app(engine, args); closed after the test."""
    clients = []

    def make(engine: FakeEngine, **args):
        client = app_client(engine, **args)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
