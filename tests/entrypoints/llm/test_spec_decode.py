"""Speculative decoding end to end through `LLM`: n-gram drafts verified by the target model.

Greedy output must be token-for-token what transformers generates (and what tokenos generates without
speculation), with logprobs as close, under every scheduling path: mixed batches, chunked prefill,
prefix hits, preemption and n > 1; drafts must really be accepted (the metrics say how many), and a
request whose output is a copy of its prompt must take fewer steps.
"""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, make_llm
from tokenos import SamplingParams
from tokenos.bench.recording import record_schedules

# Speculation on at any batch size here (the default turns it off above 8 running requests).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 64,
}


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (so prompt lookup has something to find) plus random ones."""
    phrases = DENSE.prompts(n, 4, 12, seed=seed)
    return [p * 3 for p in phrases] + DENSE.prompts(2, 5, 40, seed=seed + 1)


def accepted(llm) -> int:
    return llm.get_metrics()["spec_decoding"]["num_accepted_tokens"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_num_batched_tokens": 7},  # drafts cut by the budget, prompts chunked beside decodes
        {"num_kv_blocks": 13, "block_size": 16, "enable_prefix_caching": False},  # preemption
    ],
    ids=["mixed", "chunked7", "preempt"],
)
def test_greedy_parity_with_ngram_drafts(tiny_llama, kwargs):
    folder, ref = tiny_llama
    prompts = repetitive_prompts(5, seed=3)
    llm = make_llm(folder, speculative_config=NGRAM, max_model_len=128, **kwargs)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_accepted_tokens"] > 0, metrics
    assert 1.0 < metrics["mean_acceptance_length"] <= 5.0
    if "num_kv_blocks" in kwargs:
        assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 7}], ids=["mixed", "chunked7"])
def test_greedy_without_logprobs_verifies_on_the_argmax_alone(tiny_llama, kwargs):
    """No logprobs and nothing that edits a logit: each draft is checked against its row's argmax (the
    runner's `_greedy_targets`, without the rejection sampler's metadata); the tokens stay
    transformers' greedy ones, and some drafts are accepted, some rejected."""
    folder, ref = tiny_llama
    prompts = repetitive_prompts(5, seed=3)
    llm = make_llm(folder, speculative_config=NGRAM, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=DENSE.max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == DENSE.reference(ref, prompt, DENSE.max_tokens)[0]
    metrics = llm.get_metrics()["spec_decoding"]
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics


@pytest.mark.slow
def test_prefix_hits_and_n_gt_1_keep_parity(tiny_llama):
    folder, ref = tiny_llama
    shared = DENSE.prompts(1, 40, 40, seed=9)[0]
    prompts = [shared + shared[:12] + tail for tail in DENSE.prompts(3, 1, 10, seed=10)]
    llm = make_llm(folder, speculative_config=NGRAM, block_size=16)
    first = DENSE.run(llm, prompts)
    again = DENSE.run(llm, prompts, n=3)
    DENSE.check(first, prompts, ref)
    DENSE.check(again, prompts, ref)
    assert all(o.num_cached_tokens >= 48 for o in again)
    assert llm.get_metrics()["spec_decoding"]["num_draft_tokens"] > 0


def test_suffix_decoding_keeps_parity_and_learns_from_earlier_answers(tiny_llama):
    """Suffix drafts: the same prompts twice; the second time the global tree of earlier responses
    proposes the first answers, so more drafts are accepted, and greedy output stays transformers'."""
    folder, ref = tiny_llama
    prompts = DENSE.prompts(4, 5, 30, seed=12)
    llm = make_llm(folder, speculative_config={"method": "suffix", "disable_by_batch_size": 64})
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    first = llm.get_metrics()["spec_decoding"]["num_accepted_tokens"]
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    again = llm.get_metrics()["spec_decoding"]["num_accepted_tokens"] - first
    assert again >= len(prompts) * (DENSE.max_tokens // 2), (first, again)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_every_dense_family_keeps_parity(family, tmp_path):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, perturbed=False, **LLM_SHAPE)
    prompts = repetitive_prompts(3, seed=5)
    llm = make_llm(folder, speculative_config=NGRAM)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)


@pytest.mark.slow
def test_a_copy_takes_fewer_steps_and_the_same_logprobs():
    """The embedded SmolLM2 asked to repeat a sentence: prompt lookup guesses the copy, so the answer takes
    a fraction of the steps, token for token and logprob for logprob what plain decoding gives."""
    from tokenos import LLM

    text = (
        "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and "
        "watched the ships pass safely through the narrow channel below."
    )
    messages = [{"role": "user", "content": f"Repeat this sentence exactly:\n{text}"}]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    answers, steps = [], []
    for config in (None, NGRAM):
        llm = LLM(dtype="float32", max_model_len=512, speculative_config=config)
        recorded = record_schedules(llm)
        answers.append(llm.chat(messages, params, use_tqdm=False)[0].outputs[0])
        steps.append(len(recorded))
    want, got = answers
    assert got.token_ids == want.token_ids and text[:60] in got.text
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    assert steps[1] * 2 < steps[0], steps
    assert llm.get_metrics()["spec_decoding"]["acceptance_rate"] > 0.5


def test_seeded_sampling_is_reproducible_under_speculation(tiny_llama):
    folder, _ = tiny_llama
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    llm = make_llm(folder, speculative_config=NGRAM)
    runs = [
        [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_what_speculation_cannot_serve_is_refused(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="not built"):
        make_llm(folder, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported"):
        make_llm(folder, speculative_config={"method": "ngram", "model": "some/drafter"})
    # Hybrids speculate (tests/entrypoints/llm/test_hybrid_spec_decode.py), but an "align" checkpoint
    # every token leaves no page for a verify step's states.
    hybrid = str(tmp_path / "bamba")
    save_tiny("bamba", hybrid)
    with pytest.raises(ValueError, match="no room for drafts"):
        make_llm(hybrid, speculative_config=NGRAM, mamba_checkpoint_interval=1, num_kv_blocks=64)


def test_a_failing_verification_falls_back_to_plain_sampling(tiny_llama):
    """If the rejection sampler raises, the step goes on: every draft counts as rejected and each request
    samples its real next position alone, so the output is still exactly right."""
    folder, ref = tiny_llama
    prompts = repetitive_prompts(3, seed=6)
    llm = make_llm(folder, speculative_config=NGRAM)

    def broken(*args, **kwargs):
        raise RuntimeError("verification broke")

    llm.engine.model_runner.rejection_sampler = broken
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    spec = llm.get_metrics()["spec_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] == 0
