"""Page epochs (`worker/kv_cache.py` `PageEpochs`, `ModelRunner._bump_page_epochs`): the key under which
the C kernels keep packed copies of shared pages between steps (csrc/packed_prefix.h)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import generate_greedy, make_llm, random_prompts
from tokenos.layers import cpu_kernels
from tokenos.platform import native_bf16_supported

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.uses_cascade() or not native_bf16_supported(),
    reason="the packed-prefix cache needs the AVX512-BF16 kernels",
)

BLOCK = 16


def _run(llm, prompts: list[list[int]]):
    """The first prompt alone (its pages cached), then the others together over its cached prefix:
    (each later request's handed pages with their epochs before and after its step, the outputs)."""
    runner = llm.engine.model_runner
    bump = runner._bump_page_epochs
    handed = []

    def spy(scheduler_output) -> None:
        before = runner.page_epochs.epochs.clone()
        bump(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            handed.append((new, before, runner.page_epochs.epochs.clone()))

    runner._bump_page_epochs = spy
    try:
        generate_greedy(llm, prompts[:1], max_tokens=4)
        handed.clear()
        out = generate_greedy(llm, prompts[1:], max_tokens=24)
    finally:
        runner._bump_page_epochs = bump
    samples = [o.outputs[0] for o in out]
    logprobs = [[lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)] for s in samples]
    return handed, [(s.token_ids, lps) for s, lps in zip(samples, logprobs, strict=True)]


def test_prefix_hit_pages_keep_their_epochs_and_their_packed_copies(tmp_path):
    """A request whose prompt finds cached pages is handed them without new epochs (a cached page is
    never written while cached), its other pages with new ones; so the packed copy of the shared
    prefix made for the first requests over it serves those that join later, and the outputs are
    those of packing it afresh on every call (the cache bounded to nothing)."""
    folder = str(tmp_path / "llama")
    save_tiny("llama", folder, **LLM_SHAPE)
    llm = make_llm(folder, dtype="bfloat16", enable_prefix_caching=True, block_size=BLOCK)
    shared = random_prompts(1, 160, 160, seed=1, vocab=256)[0]
    prompts = [shared + tail for tail in random_prompts(4, 5, 20, seed=2, vocab=256)]
    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()
    try:
        handed, kept = _run(llm, prompts)
        stats = cpu_kernels.cascade_cache_stats()
        assert stats["hits"] > 0
        hits = 0
        for new, before, after in handed:
            ids = torch.tensor(new.block_ids[0])
            hit = new.num_computed_tokens // BLOCK
            hits += hit
            assert torch.equal(after[ids[:hit]], before[ids[:hit]])
            assert bool((after[ids[hit:]] != before[ids[hit:]]).all())
        assert hits >= 3 * (len(shared) // BLOCK)
        llm.reset_prefix_cache()
        cpu_kernels.set_cascade_cache_limit(0)
        _, fresh = _run(llm, prompts)
        assert fresh == kept
    finally:
        cpu_kernels.set_cascade_cache_limit(None)
        cpu_kernels.clear_cascade_cache()
