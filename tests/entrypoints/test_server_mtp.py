"""`tokenos serve --speculative-config` with method "mtp": a tiny Qwen3-Next with random mtp.* weights
drafts with its own MTP layer; greedy completions are exactly the plain offline engine's and /metrics
counts the drafts under vLLM's names."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import SERVED_LLAMA, save_qwen3_next_mtp
from tests.fixtures.servers import served_spec_decode

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
    drafts, accepted, text = served_spec_decode(folder, spec, PROMPTS, max_tokens=16)
    assert drafts > 0 and 0 <= accepted <= drafts
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"}'
        in text
    )
