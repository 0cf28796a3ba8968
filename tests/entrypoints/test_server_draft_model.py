"""`tokenos serve --speculative-config` with method "draft_model": the served model drafts for itself,
so greedy completions are exactly the plain offline engine's, every draft is accepted, and /metrics
counts the drafts under vLLM's names."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.llm import make_llm
from tests.fixtures.servers import metric, running_server
from tokenos import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["one two three one two three one two", "a b c d a b c d a b", "the cat sat on the mat and the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


def test_served_draft_model_completions_equal_the_plain_engine(folder):
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 3}
    llm = make_llm(folder, skip_tokenizer_init=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with running_server(folder, "--speculative-config", json.dumps(spec)) as server:
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in got["choices"]] == want
        text = httpx.get(f"{server.url}/metrics").text
    drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total{")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total{")
    assert drafts > 0 and accepted == drafts
