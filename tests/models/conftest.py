"""Fixtures for model-parity tests: tiny random HF checkpoints and a paged-cache step runner.

``make_checkpoint(family, **overrides)`` writes a tiny float32 checkpoint with
``save_pretrained``; ``PagedRunner`` feeds token sequences through our model over a paged
KV cache with a shuffled block assignment, one scheduled step at a time, and records the
logits of every token so they can be compared position by position with transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenos.layers.attention import allocate_kv_cache
from tokenos.layers.attention_metadata import build_attention_metadata
from tokenos.layers.metadata import ForwardBatch
from tokenos.models import build_model, load_model_config

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)


def dense_config(family: str, fields: dict):
    """The transformers config of a dense family (llama, qwen2, qwen3, mistral) with ``fields``."""
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[family]
    return cls(**fields)


@pytest.fixture
def make_checkpoint(tmp_path):
    """Write a tiny random checkpoint; returns (folder, transformers reference model)."""

    def make(family: str, **overrides) -> tuple[str, torch.nn.Module]:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config = dense_config(family, {**TINY, **overrides})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
                elif "bias" in name:
                    p.normal_(0, 0.1)
        folder = str(tmp_path / family)
        model.save_pretrained(folder)
        return folder, model.eval()

    return make


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff < rel * scale, f"max |logit diff| {diff:.3g} exceeds {rel} x scale {scale:.3g}"


class PagedRunner:
    """Runs requests through ``model`` step by step over a paged cache with shuffled blocks."""

    def __init__(self, model, config, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        self.kv_caches = [
            allocate_kv_cache(
                num_blocks, block_size, config.num_key_value_heads, config.head_dim, config.dtype
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.logits: dict[int, list[torch.Tensor]] = {}

    def _ensure_blocks(self, req: int, num_tokens: int) -> None:
        blocks = self.blocks.setdefault(req, [])
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.free_blocks.pop())

    def step(self, work: list[tuple[int, list[int]]]) -> None:
        """One forward: ``work`` is [(request id, the token ids it runs this step)]."""
        input_ids, positions = [], []
        for req, tokens in work:
            start = self.computed.setdefault(req, 0)
            self._ensure_blocks(req, start + len(tokens))
            input_ids += tokens
            positions += range(start, start + len(tokens))
        meta = build_attention_metadata(
            [self.blocks[r] for r, _ in work],
            [self.computed[r] for r, _ in work],
            [len(t) for _, t in work],
            self.block_size,
        )
        batch = ForwardBatch(
            torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, [meta] * len(self.kv_caches)
        )
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden)
        offset = 0
        for req, tokens in work:
            self.logits.setdefault(req, []).append(logits[offset : offset + len(tokens)])
            self.computed[req] += len(tokens)
            offset += len(tokens)

    def request_logits(self, req: int) -> torch.Tensor:
        return torch.cat(self.logits[req])


@pytest.fixture
def load_ours():
    def load(folder: str, **kwargs):
        config = load_model_config(folder, dtype=kwargs.pop("dtype", "float32"), **kwargs)
        return build_model(config), config

    return load


@pytest.fixture
def parity():
    """The helpers above, for tests (conftest modules are not imported directly)."""

    class Parity:
        runner = PagedRunner
        logits = staticmethod(hf_logits)
        assert_close = staticmethod(assert_close_logits)

    return Parity
