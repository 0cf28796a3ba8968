"""Speculative decoding on hybrid models end to end through `LLM`: greedy tokens identical with and without
speculation, for every hybrid family, under chunked prefill, preemption, prefix hits and n > 1.

Drafts come from a scripted proposer that knows the plain greedy answer (tiny random models rarely repeat
themselves, so n-gram drafts are seldom right): right guesses spoiled at a random position, and every
third proposal empty, so steps accept all, some or none of their drafts, drafts cross recurrent page
boundaries, and a step with zero drafts follows one that accepted some (vllm#52942). The real n-gram and
suffix proposers run too. A wrong recurrent state after verification (the state one position off, a
rejected draft left in it, a checkpoint published inside the rejected tail and hit later) changes the
greedy tokens of these models.
"""

from __future__ import annotations

import random

import pytest

from tests.fixtures.checkpoints import VOCAB, save_tiny
from tests.fixtures.llm import HYBRID, forked_counts, make_llm, preemption_workload
from tokenos import SamplingParams
from tokenos.bench.recording import record_schedules

FAMILIES = ("mamba2", "bamba", "qwen3_next", "granitemoehybrid", "falcon_h1", "nemotron_h")
# The scheduling-path tests past plain parity run on one Mamba2 hybrid and the gated-DeltaNet one (every
# family runs `test_greedy_parity_with_speculation`), so the suite stays within its time on a slow CPU.
DEEP = pytest.mark.parametrize("family", ["bamba", "qwen3_next"], indirect=True)
K = 4  # drafts per step (the tiny models' recurrent pages are 32 tokens in align mode, 8 below)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 64,
}
FAST = dict(num_kv_blocks=600)  # a small pool: engines start in a second
ALL_8 = dict(mamba_cache_mode="all", mamba_checkpoint_interval=8)

# Six families, a few engines each (about 80 s a family on two cores): the fast loop has the scheduler
# simulation over every hybrid layout (tests/core/test_spec_decode.py) and the layer-level verify and
# commit (tests/worker/test_spec_verify.py) instead.
pytestmark = pytest.mark.slow


class Scripted:
    """A proposer that knows each prompt's plain greedy answer; records every step's (drafts, accepted)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.answers = answers
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, request, max_tokens: int) -> list[int]:
        self.calls += 1
        if self.calls % 3 == 0:
            return []
        out = len(request.output_token_ids)
        drafts = list(self.answers[tuple(request.prompt_token_ids)][out : out + min(K, max_tokens)])
        if drafts and self.rng.random() < 0.6:
            i = self.rng.randrange(len(drafts))
            drafts[i] = (drafts[i] + 1 + self.rng.randrange(VOCAB - 4)) % (VOCAB - 3) + 3
        return drafts

    def forget(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp(request.param))
    save_tiny(request.param, folder)
    return folder


def prompts_for(seed: int) -> list[list[int]]:
    """Random prompts beside repeated phrases (the n-gram proposer finds the repeats)."""
    return [p * 4 for p in HYBRID.prompts(2, 4, 8, seed=seed)] + HYBRID.prompts(3, 5, 45, seed=seed + 1)


def greedy(llm, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in HYBRID.run(llm, prompts, n=n)]


def plain_answers(folder: str, prompts: list[list[int]], **kwargs) -> dict[tuple[int, ...], list[int]]:
    llm = make_llm(folder, **{**FAST, **kwargs})
    return {tuple(p): out[0] for p, out in zip(prompts, greedy(llm, prompts), strict=True)}


def scripted_llm(folder: str, answers, seed: int = 0, **kwargs):
    llm = make_llm(folder, speculative_config=SPEC, **{**FAST, **kwargs})
    llm.engine.scheduler.proposer = Scripted(answers, seed)
    return llm


def spec_stats(llm) -> dict:
    return llm.get_metrics()["spec_decoding"]


def assert_accepted_and_rejected(llm) -> None:
    s = spec_stats(llm)
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_num_batched_tokens": 7},  # drafts cut by the budget, prompts chunked beside verify steps
        ALL_8,  # every 8 tokens a checkpoint page: verify steps cross them
    ],
    ids=["mixed", "chunked7", "all8"],
)
def test_greedy_parity_with_speculation(family, kwargs):
    prompts = prompts_for(3)
    answers = plain_answers(family, prompts)
    llm = scripted_llm(family, answers, **kwargs)
    assert greedy(llm, prompts) == [[answers[tuple(p)]] for p in prompts]
    assert_accepted_and_rejected(llm)


@DEEP
def test_greedy_without_logprobs_commits_the_accepted_state(family):
    """Verified on the argmax alone (no logprobs: the runner's `_greedy_targets`): the recurrent state
    committed after each verify step is still the accepted position's."""
    prompts = prompts_for(3)
    answers = plain_answers(family, prompts)
    llm = scripted_llm(family, answers)
    params = SamplingParams(temperature=0.0, max_tokens=HYBRID.max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [answers[tuple(p)] for p in prompts]
    assert_accepted_and_rejected(llm)


@DEEP
def test_preemption_with_speculation(family):
    """A pool for one max-length request: prompts 2 tokens short of a page boundary, so verify steps soon
    need new pages in every group while the pool is full (test_hybrid_parity's recipe)."""
    need, prompts = preemption_workload(family, **FAST)
    answers = plain_answers(family, prompts, max_model_len=128)
    kwargs = dict(max_model_len=128, num_kv_blocks=need + 1, enable_prefix_caching=False)
    llm = scripted_llm(family, answers, **kwargs)
    assert greedy(llm, prompts) == [[answers[tuple(p)]] for p in prompts]
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_accepted_and_rejected(llm)


@DEEP
def test_zero_drafts_right_after_an_accepted_step(family):
    """vllm#52942: a step with no drafts right after one that accepted some must start from the accepted
    state, not the pre-speculation one nor the end of the rejected tail."""
    prompts = prompts_for(5)[:3]
    answers = plain_answers(family, prompts)
    llm = scripted_llm(family, answers, seed=1)
    scheduled = record_schedules(llm)
    assert greedy(llm, prompts) == [[answers[tuple(p)]] for p in prompts]
    seen = False
    for before, after in zip(scheduled, scheduled[1:], strict=False):
        for rid, drafts in before.scheduled_spec_decode_tokens.items():
            if drafts and rid in after.num_scheduled_tokens and rid not in after.scheduled_spec_decode_tokens:
                seen = True
    assert seen and spec_stats(llm)["num_accepted_tokens"] > 0


@DEEP
@pytest.mark.parametrize("kwargs", [{}, ALL_8], ids=["align", "all8"])
def test_prefix_hits_with_speculation(family, kwargs):
    """vllm#47194: requests that resume from recurrent checkpoints (and exact end states) published by
    speculating requests, and speculate themselves, keep parity; so does the next turn of a chat that
    resumes from a speculating request's end."""
    shared = HYBRID.prompts(1, 70, 70, seed=7)[0]
    prompts = [shared + tail for tail in HYBRID.prompts(3, 2, 9, seed=8)]
    first = plain_answers(family, prompts, **kwargs)
    turn2 = [p + first[tuple(p)] + [5, 6, 7] for p in prompts]
    answers = {**first, **plain_answers(family, turn2, **kwargs)}
    llm = scripted_llm(family, answers, **kwargs)
    outs = [HYBRID.run(llm, [p])[0] for p in prompts + turn2]  # one at a time: each sees the earlier
    assert [o.outputs[0].token_ids for o in outs] == [answers[tuple(p)] for p in prompts + turn2]
    cached = [o.num_cached_tokens for o in outs]
    assert all(c > 0 for c in cached[1:3]), cached  # the shared prefix's checkpoints
    assert all(c >= len(p) - 1 for c, p in zip(cached[3:], prompts, strict=True)), cached  # turn 1's ends
    assert_accepted_and_rejected(llm)


@DEEP
def test_n_greater_than_one_forks_with_speculation(family):
    prompts = prompts_for(9)[:3]
    answers = plain_answers(family, prompts)
    llm = scripted_llm(family, answers)
    scheduled = record_schedules(llm)
    assert greedy(llm, prompts, n=3) == [[answers[tuple(p)]] * 3 for p in prompts]
    assert forked_counts(scheduled) == sorted(2 * [len(p) - 1 for p in prompts])
    assert_accepted_and_rejected(llm)


@DEEP
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_real_proposers_keep_parity(family, method):
    """The n-gram and suffix proposers on repeating prompts; the suffix tree also proposes the first run's
    answers the second time (they are accepted)."""
    prompts = prompts_for(11)
    answers = plain_answers(family, prompts)
    suffix = {"method": "suffix", "disable_by_batch_size": 64}
    config = {**SPEC, "method": method} if method == "ngram" else suffix
    llm = make_llm(family, speculative_config=config, **FAST)
    for _ in range(2):
        assert greedy(llm, prompts) == [[answers[tuple(p)]] for p in prompts]
    assert spec_stats(llm)["num_draft_tokens"] > 0
    if method == "suffix":
        assert spec_stats(llm)["num_accepted_tokens"] > 0
