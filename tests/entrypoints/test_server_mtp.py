"""`tokenos serve --speculative-config` with method "mtp": a tiny Qwen3-Next with random mtp.* weights
drafts with its own MTP layer; greedy completions are exactly the plain offline engine's and /metrics
counts the drafts under vLLM's names."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.checkpoints import SERVED_LLAMA, save_qwen3_next_mtp
from tests.fixtures.llm import make_llm
from tests.fixtures.servers import metric, running_server
from tokenos import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["one two three one two three one two", "the cat sat on the mat and the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tokenos.engine.tokenizer import load_tokenizer

    folder = str(tmp_path_factory.mktemp("tiny-qwen3-next-mtp"))
    save_qwen3_next_mtp(folder, vocab_size=SERVED_LLAMA["vocab_size"])
    load_tokenizer(None).hf.save_pretrained(folder)
    return folder


def test_served_mtp_completions_equal_the_plain_engine(folder):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = make_llm(folder, skip_tokenizer_init=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with running_server(folder, "--speculative-config", json.dumps(spec)) as server:
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert [c["text"] for c in got["choices"]] == want
        text = httpx.get(f"{server.url}/metrics").text
    drafts = metric(text, "vllm:spec_decode_num_draft_tokens_total{")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total{")
    assert drafts > 0 and 0 <= accepted <= drafts
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"}'
        in text
    )
