"""`tokenos serve` for real (server and engine-core processes) on a tiny random DeepSeek V3 (multi-head
latent attention, noaux_tc MoE) with SmolLM2's tokenizer: a greedy completion is transformers' greedy, and
the start-up log names the native implementation."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [1, 523, 4430, 281, 30, 7, 912, 5000, 17]


def test_served_greedy_completion_is_transformers_greedy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_served("deepseek_v3", str(tmp_path / "tiny-deepseek"))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    with running_server(folder) as server:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(folder).decode(want)
    assert "DeepseekV3ForCausalLM: tokenos implementation" in server.log
