"""`tokenos serve` for real (server and engine-core processes) on a tiny random DeepSeek V3 (multi-head
latent attention, noaux_tc MoE) with SmolLM2's tokenizer: a greedy completion is transformers' greedy, and
the start-up log names the native implementation."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.servers import served_greedy_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_served_greedy_completion_is_transformers_greedy(tmp_path):
    log = served_greedy_log(save_served("deepseek_v3", str(tmp_path / "tiny-deepseek")))
    assert "DeepseekV3ForCausalLM: tokenos implementation" in log
