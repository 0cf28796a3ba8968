"""Fixtures used by several test folders: thin wrappers of tests.fixtures (which holds the logic)."""

from __future__ import annotations

import os

# Tests read log records through pytest's capture (the root logger): tokenos's own handler stays off.
os.environ.setdefault("TOKENOS_CONFIGURE_LOGGING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.fixtures.checkpoints import save_tiny  # noqa: E402
from tests.fixtures.servers import LiveServers  # noqa: E402

# The KV pool of every engine a test starts without an explicit size (each `LLM(...)`; server subprocesses
# inherit the variable). The engine's default is a quarter of the free RAM up to 4 GiB, zeroed on
# allocation: seconds per engine, and a pool size that depends on the machine. 256 MiB is thousands of
# pages for the tiny models, more than any test needs. Set the variable yourself to test another size.
KV_CACHE_MEMORY_BYTES = str(256 << 20)


def pytest_configure(config) -> None:
    os.environ.setdefault("TOKENOS_KV_CACHE_MEMORY_BYTES", KV_CACHE_MEMORY_BYTES)


@pytest.fixture
def make_checkpoint(tmp_path):
    """``make(family, **overrides)`` writes the tiny random checkpoint of `family` (perturbed) under this
    test's tmp_path; returns (folder, transformers reference model)."""

    def make(family: str, **overrides) -> tuple[str, torch.nn.Module]:
        folder = str(tmp_path / family)
        return folder, save_tiny(family, folder, **overrides)

    return make


@pytest.fixture
def live_server():
    """``start(engine, **server args)`` serves build_app(engine) under uvicorn on a free loopback port and
    returns its base URL; every server started is stopped after the test."""
    servers = LiveServers()
    yield servers.start
    servers.close()
