"""Hybrid models (pure Mamba2, Bamba, Qwen3-Next) served for real: the server process, the engine
core in its own process, greedy completions identical to the offline LLM, and a repeated prompt
resuming from a recurrent-state checkpoint (prefix-cache hits in /metrics)."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import metric, running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=["mamba2", "bamba", "qwen3_next"])
def tiny_hybrid(request, tmp_path_factory) -> str:
    """The tiny model of the model tests, one per kind (pure Mamba2, attention + Mamba2, gated
    DeltaNet + gated attention + MoE), with the real tokenizer's vocabulary."""
    return save_served(request.param, str(tmp_path_factory.mktemp(f"tiny-{request.param}")))


def test_hybrid_served_matches_offline_and_hits_checkpoints(tiny_hybrid):
    from tokenos import LLM, SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(40, 120))] for _ in range(4)]
    # A pool that keeps every request's checkpoints (end checkpoints too) cached until the repeat.
    with running_server(tiny_hybrid, "--num-kv-blocks", "96", max_model_len=256) as server:
        body = {"model": "tiny", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        served = []
        for prompt in prompts + prompts[:1]:  # the last one repeats the first: a checkpoint hit
            r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
            assert r.status_code == 200, r.text
            served.append(r.json()["choices"][0]["text"])
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "vllm:prefix_cache_hits_total{") > 0
        # tokenos's own: the repeat resumed from a recurrent checkpoint (an end checkpoint or a page's),
        # and the per-group pages carry the recurrent groups' kind (0 pages: nothing is running now)
        resumed = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("tokenos:prefix_cache_hit_tokens_by_source_total{") and "checkpoint" in line
        )
        assert resumed > 0 and 'kind="mamba"' in metrics
    llm = LLM(tiny_hybrid, dtype="float32", max_model_len=256)
    offline = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert served[:4] == [o.outputs[0].text for o in offline]
    assert served[4] == served[0]
