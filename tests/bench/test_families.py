"""`tokenos bench families` (tokenos/bench/families.py): every family's checkpoint at the shared shape
loads and generates, and the KV bytes per request follow the layers' windows."""

from __future__ import annotations

import argparse

import pytest

from tokenos.bench import families

pytestmark = pytest.mark.slow


def test_the_gemma3_window_holds_a_fraction_of_the_llamas_kv(tmp_path):
    gemma = families.kv_bytes_per_request(
        families.write_checkpoint("gemma3", str(tmp_path / "g")), [4096, 32768], "bfloat16"
    )
    llama = families.kv_bytes_per_request(
        families.write_checkpoint("llama", str(tmp_path / "l")), [4096, 32768], "bfloat16"
    )
    # Llama: 8 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes per token.
    assert llama == {n: n * 8 * 3 * 64 * 2 * 2 for n in (4096, 32768)}
    # Gemma 3: 1 full layer of 8 grows with the context, 7 windows of 512 (+ a block) do not.
    per_layer_token = 3 * 64 * 2 * 2
    window = 7 * (512 + 16) * per_layer_token
    assert gemma == {n: n * per_layer_token + window for n in (4096, 32768)}


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "deepseek_v3"])
def test_a_family_runs_at_the_shared_shape(family, tmp_path):
    args = argparse.Namespace(num_prompts=2, input_len=8, output_len=3, dtype="float32")
    row = families.throughput(families.write_checkpoint(family, str(tmp_path / family)), args)
    assert row["output_tok_s"] > 0
