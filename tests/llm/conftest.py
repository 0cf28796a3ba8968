"""Tiny random checkpoints and a transformers reference for end-to-end `LLM` parity tests."""

from __future__ import annotations

import random

import pytest
import torch

from tests.models.conftest import TINY as MODEL_TINY
from tests.models.conftest import dense_config

# The tiny dense shape of the model-parity tests, with a larger vocab and longer context for generation.
TINY = {
    **MODEL_TINY,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
}


def build_tiny(folder: str, family: str, **overrides):
    import transformers

    torch.manual_seed(0)
    config = dense_config(family, {**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "llama")
    return folder, build_tiny(folder, "llama")


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers greedy decoding, one prompt at a time: (token ids, logprob of each)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


@pytest.fixture(scope="module", params=["mamba2", "bamba", "qwen3_next", "granitemoehybrid", "falcon_h1"])
def hybrid(request, tmp_path_factory):
    """(folder, transformers model) for each hybrid family: a tiny random float32 checkpoint."""
    from tests.models.test_hybrid_models import save_tiny

    folder = str(tmp_path_factory.mktemp(request.param))
    return folder, save_tiny(request.param, folder)
