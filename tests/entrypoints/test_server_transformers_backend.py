"""`tokenos serve --model-impl transformers` for real (server and engine-core processes): a tiny random
GPT-NeoX (no native code) with SmolLM2's tokenizer answers a greedy completion with transformers' own
greedy tokens, and the start-up log names the implementation."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import served_greedy_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_served_greedy_completion_is_transformers_greedy(tmp_path):
    log = served_greedy_log(
        save_served("gpt_neox", str(tmp_path / "tiny-neox")), "--model-impl", "transformers"
    )
    assert "GPTNeoXForCausalLM: transformers implementation" in log
