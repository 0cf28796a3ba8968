"""Prompt logprobs over HTTP against transformers on the same weights: lm-eval's loglikelihood request
(`local-completions`: token-id prompts in a batch, ``echo``, ``logprobs: 1``, ``max_tokens: 1``, then the
prompt's token_logprobs from the context length on), ``max_tokens: 0``, vLLM's ``prompt_logprobs`` on
completions and chat, and the echoed prompt in a stream. The real server, a tiny random Llama (float32)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[1, 523, 4430, 281, 30, 7, 912], [5000, 17, 17, 17, 99, 31000, 2048, 12, 600, 3]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(folder):
    with running_server(folder) as server:
        yield server


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' logprob of every prompt token given the tokens before it, and its top-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in PROMPTS:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            rows.append(
                [(logprobs[p - 1, ids[p]].item(), logprobs[p - 1].max().item()) for p in range(1, len(ids))]
            )
    return rows


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request_matches_transformers(server, reference):
    body = {"prompt": PROMPTS, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    choices = sorted(post(server, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    for ids, ref, choice in zip(PROMPTS, reference, choices, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        ours = logprobs["token_logprobs"][1:-1]
        assert ours == pytest.approx([lp for lp, _ in ref], abs=2e-3)
        # lm-eval's is_greedy: the token's logprob against the best in its top_logprobs
        for (_, best), top in zip(ref, logprobs["top_logprobs"][1:-1], strict=True):
            assert max(top.values()) == pytest.approx(best, abs=2e-3)
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        # lm-eval sums a continuation: context of 3 tokens here
        assert sum(logprobs["token_logprobs"][3:-1]) == pytest.approx(sum(lp for lp, _ in ref[2:]), abs=5e-3)


def test_max_tokens_zero_returns_the_prompt_alone(server, reference):
    body = {"prompt": PROMPTS[0], "max_tokens": 0, "logprobs": 0, "echo": True}
    response = post(server, "/v1/completions", body)
    (choice,) = response["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(PROMPTS[0])
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([lp for lp, _ in reference[0]], abs=2e-3)
    assert response["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert (
        choice["text"] == httpx.post(f"{server.url}/detokenize", json={"tokens": PROMPTS[0]}).json()["prompt"]
    )


def test_vllm_prompt_logprobs_field(server, reference):
    completion = post(
        server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2, "prompt_logprobs": 2}
    )
    rows = completion["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPTS[1])
    for p, (row, (lp, best)) in enumerate(zip(rows[1:], reference[1], strict=True), start=1):
        entry = row[str(PROMPTS[1][p])]
        assert entry["logprob"] == pytest.approx(lp, abs=2e-3) and entry["rank"] >= 1
        assert max(e["logprob"] for e in row.values()) == pytest.approx(best, abs=2e-3)
        assert len(row) in (2, 3) and all(e["decoded_token"] is not None for e in row.values())
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat["prompt_logprobs"][0] is None and all(len(row) == 1 for row in chat["prompt_logprobs"][1:])


def test_streamed_echo_leads_with_the_scored_prompt(server, reference):
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 3,
        "logprobs": 1,
        "echo": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"model": "tiny", **body}, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert first["token_logprobs"][1 : len(PROMPTS[0])] == pytest.approx(
        [lp for lp, _ in reference[0]], abs=2e-3
    )
    tokens = sum((e["choices"][0]["logprobs"]["tokens"] for e in events if e["choices"]), [])
    assert len(tokens) == len(PROMPTS[0]) + 3
