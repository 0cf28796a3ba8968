"""`tokenos serve --speculative-config`: n-gram speculation behind the OpenAI API. Greedy completions
(streamed and not, with logprobs) are exactly the offline engine's without speculation, and /metrics
counts drafts under vLLM's names."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.llm import make_llm
from tests.fixtures.servers import Server, metric, running_server
from tokenos import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["one two three one two three one two", "a b c d a b c d a b", "the cat sat on the mat and the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def server(folder):
    with running_server(folder, "--speculative-config", json.dumps(SPEC)) as server:
        yield server


def test_served_greedy_completions_equal_the_plain_engine(server, folder):
    llm = make_llm(folder, skip_tokenizer_init=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 1}, timeout=60).json()
    for choice, ref in zip(got["choices"], want, strict=True):
        assert choice["text"] == ref.text
        ours = choice["logprobs"]["token_logprobs"]
        theirs = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    streamed = ""
    stream = {**body, "prompt": PROMPTS[0], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["choices"][0]["text"]
    assert streamed == want[0].text
    text = httpx.get(f"{server.url}/metrics").text
    drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total{")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total{")
    assert drafts > 0 and 0 < accepted <= drafts
    first = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"}'
    assert metric(text, first) > 0


def test_a_speculative_config_tokenos_does_not_build_stops_the_server(folder):
    server = Server(folder, "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}')
    try:
        with pytest.raises(RuntimeError, match="not built"):
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
