"""`tokenos serve --speculative-config` with method "draft_model": the served model drafts for itself,
so greedy completions are exactly the plain offline engine's, every draft is accepted, and /metrics
counts the drafts under vLLM's names."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import served_spec_decode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["one two three one two three one two", "a b c d a b c d a b", "the cat sat on the mat and the"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


def test_served_draft_model_completions_equal_the_plain_engine(folder):
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 3}
    drafts, accepted, _ = served_spec_decode(folder, spec, PROMPTS, max_tokens=24)
    assert drafts > 0 and accepted == drafts
