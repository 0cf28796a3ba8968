"""The engine-core process boundary: real child process, real ZeroMQ sockets, a toy core.

`tests.fixtures.echo_core.EchoCore` stands in for tokenos.engine.core.EngineCore (same interface): each step
it emits the next prompt token of every request, cycling, and finishes at max_tokens. It lives at module
level in an importable package, so the spawn-started child can unpickle its factory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.fixtures.echo_core import failing_factory, make_echo_core
from tests.fixtures.servers import REPO
from tokenos.core.messages import EngineCoreOutput, EngineCoreRequest, EngineSamplingParams, FinishReason
from tokenos.engine.core_client import (
    AsyncEngineCoreClient,
    EngineDeadError,
    EngineStartupError,
    RequestRejectedError,
)

pytestmark = pytest.mark.timeout(60)


def request(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = EngineSamplingParams(max_tokens=max_tokens)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)


async def collect(stream) -> list[EngineCoreOutput]:
    return [out async for out in stream]


@pytest.fixture
def client_factory():
    clients: list[AsyncEngineCoreClient] = []

    def make(**kwargs) -> AsyncEngineCoreClient:
        client = AsyncEngineCoreClient(make_echo_core, kwargs, heartbeat_interval_s=0.2)
        clients.append(client)
        client.start()
        return client

    yield make
    for client in clients:
        client.shutdown()


def test_ready_handshake_and_concurrent_requests(client_factory):
    client = client_factory()
    assert client.model_info == {"model": "echo", "max_model_len": 128, "num_kv_tokens": 4096}
    seen_stats: list[dict] = []
    client.stats_handler = seen_stats.append

    async def main():
        streams = [await client.add_request_async(request(f"r{i}", [i, 10 + i], 5)) for i in range(3)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert [t for o in outs for t in o.new_token_ids] == [i, 10 + i, i, 10 + i, i]
        assert [o.finished for o in outs] == [False] * 4 + [True]
        assert outs[-1].finish_reason == FinishReason.LENGTH
    assert seen_stats and seen_stats[-1]["num_finished"] == 3


def test_startup_error_is_raised_with_the_childs_reason():
    client = AsyncEngineCoreClient(failing_factory)
    with pytest.raises(EngineStartupError, match="model 'no/such-model' not found"):
        client.start()
    assert not client.proc.is_alive()


def test_rejected_request_fails_alone(client_factory):
    client = client_factory()

    async def main():
        bad = await client.add_request_async(request("bad", [], 3))
        with pytest.raises(RequestRejectedError, match="prompt must not be empty"):
            await collect(bad)
        good = await collect(await client.add_request_async(request("good", [7], 2)))
        return good

    assert [o.new_token_ids for o in asyncio.run(main())] == [[7], [7]]
    assert not client.errored


def test_abort_ends_the_stream_and_frees_the_core(client_factory):
    client = client_factory(step_delay_s=0.01)
    pushed_stats: list[dict] = []
    client.stats_handler = pushed_stats.append

    async def main():
        stream = await client.add_request_async(request("long", [1], 100_000))
        first = await stream.__anext__()
        await client.abort_requests_async(["long"])
        rest = await collect(stream)
        for _ in range(200):  # the abort is asynchronous: wait until the core reports it went idle
            if pushed_stats[-1]["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        return first, rest, await client.call_utility_async("get_stats")

    first, rest, stats = asyncio.run(main())
    assert first.new_token_ids == [1]
    assert rest[-1].finish_reason == FinishReason.ABORT
    # Going idle is reported without any further step, so the frontend's gauges drop to zero.
    assert pushed_stats[-1]["num_running"] == 0
    assert stats["num_running"] == 0


def test_utilities(client_factory):
    client = client_factory()

    async def main():
        assert await client.call_utility_async("reset_prefix_cache") is True
        assert (await client.call_utility_async("get_model_info"))["model"] == "echo"
        with pytest.raises(RuntimeError, match="no utility 'nope'"):
            await client.call_utility_async("nope")
        with pytest.raises(RuntimeError, match="no utility"):
            await client.call_utility_async("_private")

    asyncio.run(main())


def test_killed_child_fails_in_flight_requests(client_factory):
    client = client_factory(step_delay_s=0.01)

    async def main():
        streams = [await client.add_request_async(request(f"r{i}", [i], 100_000)) for i in range(2)]
        await streams[0].__anext__()
        os.kill(client.proc.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                await asyncio.wait_for(collect(stream), timeout=20)
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request("late", [1], 1))
        with pytest.raises(EngineDeadError):
            await client.check_health()

    asyncio.run(main())
    assert client.errored


def test_core_crash_is_reported_as_engine_death(client_factory):
    client = client_factory(crash_on=666)

    async def main():
        stream = await client.add_request_async(request("doomed", [666], 3))
        with pytest.raises(EngineDeadError, match="boom: the model exploded"):
            await asyncio.wait_for(collect(stream), timeout=20)

    asyncio.run(main())
    client.proc.join(timeout=10)
    assert client.proc.exitcode not in (0, None)


def test_wedged_core_is_detected_by_silence():
    client = AsyncEngineCoreClient(
        make_echo_core, {"step_delay_s": 30.0}, heartbeat_interval_s=0.2, silence_timeout_s=1.0
    )
    client.start()
    try:

        async def main():
            stream = await client.add_request_async(request("stuck", [1], 1))
            with pytest.raises(EngineDeadError, match="sent nothing"):
                await asyncio.wait_for(collect(stream), timeout=20)

        asyncio.run(main())
        client.proc.join(timeout=10)
        assert not client.proc.is_alive()  # the client killed it
    finally:
        client.shutdown()


def test_shutdown_stops_the_child_cleanly(client_factory):
    client = client_factory()
    client.shutdown()
    assert client.proc.exitcode == 0


def test_child_exits_when_its_parent_dies(tmp_path):
    # A parent process that starts an engine core, prints the child's pid, then is SIGKILLed.
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from tests.fixtures.echo_core import make_echo_core
        from tokenos.engine.core_client import AsyncEngineCoreClient
        if __name__ == "__main__":
            client = AsyncEngineCoreClient(make_echo_core, heartbeat_interval_s=0.2)
            client.start()
            print(client.proc.pid, flush=True)
            time.sleep(60)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(child_pid):
            time.sleep(0.1)
        assert not _alive(child_pid)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
