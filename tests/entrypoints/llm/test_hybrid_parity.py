"""Hybrid models end to end through `LLM`: greedy tokens identical to transformers and logprobs
close, with chunked prefill at odd budgets, mixed batches, prefix-cache hits on recurrent-state
checkpoints (including a hit followed by a different suffix), n > 1 and preemption."""

from __future__ import annotations

import pytest

from tests.fixtures.llm import HYBRID, forked_counts, make_llm, preemption_workload
from tokenos.bench.recording import record_schedules

# Greedy tokens identical to transformers' (recomputed without a cache), logprobs within 1e-3.
prompts_of, run, check = HYBRID.prompts, HYBRID.run, HYBRID.check

# End to end for five families, each test a few engines: the fast loop has the model-level parity
# of every family in tests/models instead.
pytestmark = pytest.mark.slow
MAX_TOKENS = HYBRID.max_tokens


def test_chunked_mixed_batch(hybrid):
    folder, ref = hybrid
    prompts = prompts_of(5, 1, 90, seed=1)
    llm = make_llm(folder, max_num_batched_tokens=13)
    check(run(llm, prompts), prompts, ref)


def test_prefix_hits_resume_from_checkpoints(hybrid):
    folder, ref = hybrid
    llm = make_llm(folder)
    block = llm.engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    shared = prompts_of(1, 3 * block + 5, 3 * block + 5, seed=2)[0]
    first = run(llm, [shared])
    check(first, [shared], ref)
    # The same prompt again, then its first 3 blocks with different suffixes. Align mode keeps the
    # state checkpoint at the prompt's last block boundary (3 blocks), so every one of them resumes
    # there and scans only its suffix.
    prompts = [shared] + [shared[: 3 * block + 2] + tail for tail in prompts_of(2, 1, 9, seed=3)]
    again = run(llm, prompts)
    check(again, prompts, ref)
    assert [o.num_cached_tokens for o in again] == [3 * block] * 3


def test_n_greater_than_one(hybrid):
    """Samples 1 and 2 fork from sample 0 once it has computed the prompt but its last token:
    each copies the recurrent state eagerly and computes that one token itself."""
    folder, ref = hybrid
    prompts = prompts_of(2, 20, 50, seed=4)
    llm = make_llm(folder)
    scheduled = record_schedules(llm)
    outputs = run(llm, prompts, n=3)
    assert all(len(o.outputs) == 3 for o in outputs)
    check(outputs, prompts, ref)
    computed = sum(out.total_num_scheduled_tokens for out in scheduled)
    # Per prompt: the prompt once, the last prompt token twice more, 7 decode tokens per sample.
    assert computed == sum(len(p) + 2 + 3 * (MAX_TOKENS - 1) for p in prompts)
    assert forked_counts(scheduled) == sorted(2 * [len(p) - 1 for p in prompts])


def test_preemption(hybrid):
    folder, ref = hybrid
    need, prompts = preemption_workload(folder)
    llm = make_llm(folder, max_model_len=128, num_kv_blocks=need + 1, enable_prefix_caching=False)
    outputs = run(llm, prompts)
    check(outputs, prompts, ref)
    assert llm.get_metrics()["num_preemptions"] > 0
