"""What a server operator sees (the real server): the periodic stats line and its off switch, request
lines with --enable-log-requests, and a clean exit (0, no traceback) on SIGINT and on SIGTERM."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


def serve_once(folder: str, stop: signal.Signals, *flags: str) -> tuple[int, str]:
    server = Server(folder, *flags)
    server.wait_ready()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
    assert r.status_code == 200
    time.sleep(1.5)  # three stats intervals
    server.proc.send_signal(stop)
    out, _ = server.proc.communicate(timeout=60)
    return server.proc.returncode, out


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_stats_request_lines_and_a_clean_exit(folder, monkeypatch, stop):
    monkeypatch.setenv("TOKENOS_LOG_STATS_INTERVAL_S", "0.5")
    code, out = serve_once(folder, stop, "--enable-log-requests")
    assert code == 0 and "Traceback" not in out, out[-3000:]
    assert "Received request cmpl-" in out and f"{stop.name} received" in out
    busy = re.findall(
        r"Avg generation throughput: ([0-9.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs", out
    )
    assert any(float(rate) > 0 for rate in busy), out[-3000:]


def test_disable_log_stats(folder, monkeypatch):
    monkeypatch.setenv("TOKENOS_LOG_STATS_INTERVAL_S", "0.5")
    code, out = serve_once(folder, signal.SIGINT, "--disable-log-stats")
    assert code == 0 and "Avg prompt throughput" not in out and "Received request" not in out
