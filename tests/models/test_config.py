"""Model config resolution (tokenos/models/config.py): fields a checkpoint's config.json gives, legacy
keys, and the errors a user can cause."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.llm import DENSE, make_llm, random_prompts
from tokenos.models import load_model_config
from tokenos.platform import native_bf16_supported


def test_config_fields(make_checkpoint):
    folder, _ = make_checkpoint("mistral", sliding_window=8, eos_token_id=[2, 5])
    config = load_model_config(folder, max_model_len=100)
    assert config.architecture == "MistralForCausalLM" and config.max_model_len == 100
    assert config.layer_sliding_windows == (8, 8) and config.eos_token_ids == (2, 5)
    assert (config.num_key_value_heads, config.head_dim) == (2, 16)
    # auto: bf16 where the CPU runs it natively, whatever the checkpoint stores (float32 here)
    assert config.dtype == (torch.bfloat16 if native_bf16_supported() else torch.float32)
    with pytest.raises(ValueError, match="TOKENOS_ALLOW_LONG_MAX_MODEL_LEN"):
        load_model_config(folder, max_model_len=10**6)
    with pytest.raises(ValueError, match="at least 1"):
        load_model_config(folder, max_model_len=0)
    with pytest.raises(ValueError, match="dtype"):
        load_model_config(folder, dtype="int8")


def test_legacy_rope_keys(make_checkpoint):
    folder, _ = make_checkpoint("llama")
    with open(f"{folder}/config.json") as f:
        raw = json.load(f)
    raw.pop("rope_parameters")
    raw["rope_theta"] = 5000.0
    raw["rope_scaling"] = {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32}  # fmt: skip
    with open(f"{folder}/config.json", "w") as f:
        json.dump(raw, f)
    config = load_model_config(folder)
    assert config.rope_theta == 5000.0 and config.rope_scaling["rope_type"] == "llama3"


def test_unsupported_architecture_lists_supported(make_checkpoint):
    folder, _ = make_checkpoint("llama")
    with open(f"{folder}/config.json") as f:
        raw = json.load(f)
    raw["architectures"] = ["NoSuchForCausalLM"]  # neither native nor known to transformers
    with open(f"{folder}/config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        load_model_config(folder)


@pytest.mark.parametrize("variable", ["TOKENOS_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"])
def test_max_model_len_past_the_trained_context_when_the_environment_allows(
    make_checkpoint, monkeypatch, variable
):
    folder, ref = make_checkpoint("llama", max_position_embeddings=48)
    monkeypatch.setenv(variable, "1")
    assert load_model_config(folder, max_model_len=96).max_model_len == 96
    # Default RoPE has no length in it, so transformers (which computes angles per position) is
    # still the reference past 48 tokens: our tables must reach there and stay exact.
    llm = make_llm(folder, max_model_len=96, num_kv_blocks=32)
    prompts = random_prompts(2, 60, 80, seed=3, vocab=ref.config.vocab_size)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
