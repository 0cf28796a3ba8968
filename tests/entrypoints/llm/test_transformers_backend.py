"""End-to-end: `LLM` on the transformers backend (our scheduler, paged pool and sampler) against
transformers' `generate` on the same tiny weights: greedy tokens identical and logprobs within 1e-3 under
chunked prefill, prefix-cache hits, preemption and n > 1, for two families without native code (chosen
automatically) and Llama forced with ``model_impl="transformers"``."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, forked_counts, make_llm
from tokenos.bench.recording import record_schedules
from tokenos.models.transformers_backend import TransformersCausalLM

random_prompts, run_ours, check_parity = DENSE.prompts, DENSE.run, DENSE.check


@pytest.fixture(scope="module", params=["gpt_neox", "starcoder2"])
def backend_family(request, tmp_path_factory):
    """(folder, transformers model): a family tokenos runs only through the backend (StarCoder2 with a
    24-token window, so generations cross it)."""
    folder = str(tmp_path_factory.mktemp(request.param))
    overrides = {"sliding_window": 24} if request.param == "starcoder2" else {}
    return folder, save_tiny(request.param, folder, perturbed=False, **LLM_SHAPE, **overrides)


def _model(llm):
    return llm.engine.model_runner.model


def test_chunked_prefill_and_prefix_hits_keep_parity(backend_family):
    folder, ref = backend_family
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(3, 1, 15, seed=8)]
    # A 24-token budget: every prompt arrives in chunks, mixed with the others' decodes.
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    assert isinstance(_model(llm), TransformersCausalLM)  # chosen automatically: no native code
    first = run_ours(llm, prompts)
    check_parity(first, prompts, ref)
    again = run_ours(llm, prompts)
    check_parity(again, prompts, ref)
    assert all(o.num_cached_tokens >= 32 for o in again), [o.num_cached_tokens for o in again]


def test_preemption_and_n_greater_than_one_keep_parity(backend_family):
    folder, ref = backend_family
    prompts = random_prompts(4, 30, 50, seed=11)
    # 16 usable blocks of 16 tokens cannot hold 8 samples of ~55 tokens: the scheduler must preempt.
    llm = make_llm(folder, block_size=16, num_kv_blocks=17, max_model_len=128)
    scheduled = record_schedules(llm)
    outputs = run_ours(llm, prompts, n=2)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert all(len(o.outputs) == 2 for o in outputs)
    check_parity(outputs, prompts, ref)
    assert forked_counts(scheduled), "no sample was admitted on its sibling's pages"


def test_forced_transformers_backend_on_a_native_architecture(tiny_llama):
    folder, ref = tiny_llama
    prompts = random_prompts(3, 5, 40, seed=5)
    llm = make_llm(folder, model_impl="transformers", block_size=16, max_num_batched_tokens=16)
    assert isinstance(_model(llm), TransformersCausalLM)
    check_parity(run_ours(llm, prompts, n=2), prompts, ref)
    native = make_llm(folder, model_impl="vllm")
    assert not isinstance(_model(native), TransformersCausalLM)
