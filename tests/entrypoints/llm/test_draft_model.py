"""Speculative method "draft_model" through `LLM`: a small model of the target's vocabulary drafts, the
target verifies.

Greedy output must be token for token transformers' under every scheduling path (mixed batches, chunked
prefill, preemption, prefix hits, n > 1). With the target as its own drafter every draft must be
accepted, greedy or sampled (q = p makes min(1, p / q) = 1): any drafter K/V missing or stale, or a q
that is not the drafts' own, shows as a rejection. A different drafter is accepted in part. Sampled
output must be distributed as the target's (chi-square against the exact distribution).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, make_llm
from tokenos import SamplingParams


def draft_config(model: str, k: int = 3, disable_by_batch_size: int = 64) -> dict:
    return {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": k,
        "disable_by_batch_size": disable_by_batch_size,
    }


@pytest.fixture(scope="module")
def noisy_drafter(tiny_llama, tmp_path_factory) -> str:
    """The target's weights with noise on every matrix: same vocabulary and pages, other argmaxes now
    and then (acceptance partial)."""
    folder, ref = tiny_llama
    drafter = str(tmp_path_factory.mktemp("drafter") / "llama")
    shutil.copytree(folder, drafter)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.add_(torch.randn_like(p) * 0.15 * p.std())
    model.save_pretrained(drafter)
    return drafter


def spec_metrics(llm) -> dict:
    return llm.get_metrics()["spec_decoding"]


SCHEDULES = [
    {},
    {"max_num_batched_tokens": 7},  # prompts chunked beside verification steps, drafts cut by the budget
    {"num_kv_blocks": 10, "block_size": 16, "enable_prefix_caching": False},  # preemption
]
SCHEDULE_IDS = ["mixed", "chunked7", "preempt"]


@pytest.mark.parametrize("kwargs", SCHEDULES, ids=SCHEDULE_IDS)
def test_the_target_as_its_own_drafter_is_always_accepted(tiny_llama, kwargs):
    folder, ref = tiny_llama
    prompts = DENSE.prompts(5, 20, 40, seed=3)
    llm = make_llm(folder, speculative_config=draft_config(folder), max_model_len=128, **kwargs)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    spec = spec_metrics(llm)
    assert spec["num_draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0, spec
    if "num_kv_blocks" in kwargs:
        assert llm.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("kwargs", SCHEDULES[:2], ids=SCHEDULE_IDS[:2])
def test_another_drafter_is_accepted_in_part_and_greedy_stays_exact(tiny_llama, noisy_drafter, kwargs):
    folder, ref = tiny_llama
    prompts = DENSE.prompts(5, 5, 40, seed=4)
    llm = make_llm(folder, speculative_config=draft_config(noisy_drafter), max_model_len=128, **kwargs)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    spec = spec_metrics(llm)
    assert 0.0 < spec["acceptance_rate"] < 1.0, spec


def test_prefix_hits_and_n_gt_1_serve_the_drafter_too(tiny_llama):
    """A second pass hits the first pass's blocks (with n = 3 forks on them): the drafter reads its K/V
    from those pages, so it still drafts exactly what the target would (every draft accepted)."""
    folder, ref = tiny_llama
    shared = DENSE.prompts(1, 40, 40, seed=9)[0]
    prompts = [shared + tail for tail in DENSE.prompts(3, 1, 10, seed=10)]
    llm = make_llm(folder, speculative_config=draft_config(folder), block_size=16)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    again = DENSE.run(llm, prompts, n=3)
    DENSE.check(again, prompts, ref)
    assert all(o.num_cached_tokens >= 32 for o in again)
    spec = spec_metrics(llm)
    assert spec["num_draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0, spec


def test_sampled_drafts_of_the_target_itself_are_always_accepted(tiny_llama):
    """q = p: min(1, p / q) is 1, so a sampled draft is never rejected, provided q is the very distribution
    each draft was drawn from (a one-hot q, a stale or shifted one, would reject some). Seeded runs repeat."""
    folder, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in DENSE.prompts(4, 5, 20, seed=5)]
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
    llm = make_llm(folder, speculative_config=draft_config(folder))
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1]
    spec = spec_metrics(llm)
    assert spec["num_draft_tokens"] > 20 and spec["acceptance_rate"] == 1.0, spec


@pytest.mark.slow
def test_sampled_output_is_the_targets_distribution(tiny_llama, noisy_drafter):
    """The second token of many samples of one prompt (verified from the noisy drafter's sampled draft,
    with its q) against its exact marginal sum_a p(a) p(b | a) from transformers: a chi-square test over
    the likely tokens (the rest pooled)."""
    folder, ref = tiny_llama
    prompt = DENSE.prompts(1, 6, 6, seed=11)[0]
    temperature, num_samples = 0.7, 1500
    llm = make_llm(folder, speculative_config=draft_config(noisy_drafter, 2, 256), max_num_seqs=256)
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=None)
    outs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params, use_tqdm=False)
    spec = spec_metrics(llm)
    assert spec["num_draft_tokens"] == num_samples and 0.05 < spec["acceptance_rate"] < 1.0, spec
    seconds = [o.outputs[0].token_ids[1] for o in outs]
    want = exact_second_token(ref, prompt, temperature)
    counts = torch.bincount(torch.tensor(seconds), minlength=want.numel()).double()
    p_value = chi_square_p_value(counts, want * num_samples)
    assert p_value > 1e-3, p_value


def exact_second_token(ref, prompt: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        first = torch.softmax(ref(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = first.numel()
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        second = torch.softmax(ref(seqs).logits[:, -1] / temperature, -1)
    return (first[:, None] * second).sum(0).double()


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test over the cells expecting >= 5 (the rest pooled into one), Wilson-Hilferty p-value."""
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = len(obs) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_what_a_draft_model_cannot_serve_is_refused(tiny_llama, tmp_path):
    folder, _ = tiny_llama
    other_vocab = str(tmp_path / "vocab")
    save_tiny("llama", other_vocab, perturbed=False, **{**LLM_SHAPE, "vocab_size": 128})
    with pytest.raises(ValueError, match="vocabulary of 128 tokens"):
        make_llm(folder, speculative_config=draft_config(other_vocab))
    other_heads = str(tmp_path / "heads")
    save_tiny("llama", other_heads, perturbed=False, **{**LLM_SHAPE, "head_dim": 32, "hidden_size": 128})
    with pytest.raises(ValueError, match="KV heads and head size"):
        make_llm(folder, speculative_config=draft_config(other_heads))
    hybrid = str(tmp_path / "bamba")
    save_tiny("bamba", hybrid, vocab_size=LLM_SHAPE["vocab_size"])
    with pytest.raises(ValueError, match="hybrid"):
        make_llm(folder, speculative_config=draft_config(hybrid))
    with pytest.raises(ValueError, match="hybrid"):
        make_llm(hybrid, speculative_config=draft_config(folder))
    with pytest.raises(ValueError, match="required"):
        make_llm(folder, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported"):
        make_llm(folder, speculative_config={**draft_config(folder), "draft_tensor_parallel_size": 1})
    with pytest.raises(FileNotFoundError):
        make_llm(folder, speculative_config=draft_config(os.path.join(folder, "missing")))


def test_a_drafter_with_another_tokenizer_is_refused(tiny_llama, tmp_path):
    """Same vocabulary size, other token strings: the drafter's ids would mean other text. The same
    tokenizer saved beside both is accepted."""
    from tests.fixtures.tokenizers import _hf, byte_level_bpe

    folder, _ = tiny_llama
    target, same, other = (str(tmp_path / name) for name in ("target", "same", "other"))
    for copy in (target, same, other):
        shutil.copytree(folder, copy)
    ours = _hf(byte_level_bpe(["hello world"] * 10, 300))
    ours.save_pretrained(target)
    ours.save_pretrained(same)
    _hf(byte_level_bpe(["a quite different corpus of words"] * 10, 300)).save_pretrained(other)
    with pytest.raises(ValueError, match="another tokenizer"):
        make_llm(target, speculative_config=draft_config(other))
    llm = make_llm(target, speculative_config=draft_config(same))
    DENSE.run(llm, DENSE.prompts(1, 5, 5, seed=1))
    assert spec_metrics(llm)["acceptance_rate"] == 1.0


def test_the_json_spelling_is_vllms(tiny_llama):
    from tokenos.core.spec_decode import SpeculativeConfig

    folder, _ = tiny_llama
    config = SpeculativeConfig.parse(
        json.dumps({"method": "draft_model", "model": folder, "num_speculative_tokens": 2})
    )
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", folder, 2)


def test_the_pool_counts_the_drafters_pages(tiny_llama, noisy_drafter):
    """The same KV memory holds half the blocks when a drafter of the target's shape shares each block
    (one more buffer per drafter layer), and its layers are in the target's group, so the block tables
    the scheduler fills cover them."""
    folder, _ = tiny_llama
    memory = 4 * 2**20
    plain = make_llm(folder, kv_cache_memory_bytes=memory).engine
    spec = make_llm(
        folder, kv_cache_memory_bytes=memory, speculative_config=draft_config(noisy_drafter)
    ).engine
    assert spec.kv_cache_config.num_blocks * 2 == plain.kv_cache_config.num_blocks
    (group,) = spec.kv_cache_config.kv_cache_groups
    assert sum(name.startswith("drafter.") for name in group.layer_names) == 2
