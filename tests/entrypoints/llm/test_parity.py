"""End-to-end parity: `LLM.generate` against transformers on the same tiny weights.

Greedy tokens must be identical and logprobs close (float32) under every scheduling path:
chunked prefill, block sizes 16 and 32, prefix-cache hits, preemption, and n > 1.
"""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, forked_counts, make_llm
from tokenos import LLM, SamplingParams
from tokenos.bench.recording import record_schedules

# Greedy tokens identical to transformers' `generate`, logprobs within 1e-3.
random_prompts, run_ours, check_parity = DENSE.prompts, DENSE.run, DENSE.check

# Marked slow: the scheduling-path and family sweeps (an engine or more each). Unmarked, in the fast
# loop: parity under preemption and the input errors, one engine each.


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_size,budget",
    [(16, 2048), (32, 2048), (16, 24), (32, 7)],
    ids=["b16", "b32", "b16-chunked24", "b32-chunked7"],
)
def test_mixed_batch_parity(tiny_llama, block_size, budget):
    folder, ref = tiny_llama
    prompts = random_prompts(6, 1, 70, seed=block_size + budget)
    llm = make_llm(folder, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=8)
    check_parity(run_ours(llm, prompts), prompts, ref)


@pytest.mark.slow
def test_prefix_cache_hits_keep_parity(tiny_llama):
    folder, ref = tiny_llama
    shared = random_prompts(1, 50, 50, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 20, seed=8)] + [shared]
    llm = make_llm(folder, block_size=16)
    first = run_ours(llm, prompts)
    check_parity(first, prompts, ref)
    assert any(o.num_cached_tokens > 0 for o in first[1:]), "prompts sharing 48 tokens never hit"
    again = run_ours(llm, prompts)
    check_parity(again, prompts, ref)
    assert all(o.num_cached_tokens >= 48 for o in again)
    metrics = llm.get_metrics()
    assert (
        metrics["prefix_cache_hits"] > 0 and metrics["prefix_cache_queries"] >= metrics["prefix_cache_hits"]
    )


def test_preemption_keeps_parity(tiny_llama):
    folder, ref = tiny_llama
    prompts = random_prompts(8, 30, 60, seed=11)
    # 16 usable blocks of 16 tokens cannot hold 8 requests of ~55 tokens: the scheduler must preempt.
    llm = make_llm(folder, block_size=16, num_kv_blocks=17, max_model_len=128, enable_prefix_caching=False)
    outputs = run_ours(llm, prompts)
    assert llm.get_metrics()["num_preemptions"] > 0
    check_parity(outputs, prompts, ref)


@pytest.mark.slow
def test_n_greater_than_one_shares_prompt(tiny_llama):
    folder, ref = tiny_llama
    prompts = random_prompts(2, 40, 60, seed=3)
    llm = make_llm(folder, block_size=16)
    scheduled = record_schedules(llm)
    outputs = run_ours(llm, prompts, n=3)
    assert all(len(o.outputs) == 3 for o in outputs)
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    check_parity(outputs, prompts, ref)
    # Samples 1 and 2 fork from sample 0: its prompt pages shared, only the last token recomputed.
    assert forked_counts(scheduled) == sorted(2 * [len(p) - 1 for p in prompts])


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_and_come_once_for_n_samples(tiny_llama):
    """Every prompt token scored (the first None), as transformers scores it; with n > 1 the prompt is
    the request's, scored once, not once per sample."""
    import torch

    folder, ref = tiny_llama
    (prompt,) = random_prompts(1, 30, 31, seed=7)
    llm = make_llm(folder, max_num_batched_tokens=8)  # the prompt's scores arrive over four chunks
    for n in (1, 3):
        (out,) = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, n=n, prompt_logprobs=0)
        )
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
        for p in range(1, len(prompt)):
            assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(
                want[p - 1, prompt[p]].item(), abs=1e-3
            )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 24}),
        # layer 0 full attention, layer 1 sliding: two KV-cache groups with their own block tables
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
        ("llama", {"tie_word_embeddings": True}),
        ("olmo2", {}),
        ("phi3", {"partial_rotary_factor": 0.5}),
    ],
)
def test_families_parity(tmp_path, family, overrides):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, perturbed=False, **LLM_SHAPE, **overrides)
    prompts = random_prompts(4, 5, 60, seed=5)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=32)
    check_parity(run_ours(llm, prompts), prompts, ref)


@pytest.mark.slow
def test_seeded_sampling_reproducible(tiny_llama):
    folder, _ = tiny_llama
    prompts = random_prompts(3, 10, 30, seed=9)
    llm = make_llm(folder)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_bad_input_is_a_clear_error(tiny_llama):
    folder, _ = tiny_llama
    llm = make_llm(folder, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": list(range(3, 80))}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [5, 99999]}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("text needs a tokenizer", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="Unknown LLM argument"):
        LLM(folder, not_a_flag=1)
    # the engine still serves after the bad requests
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2
