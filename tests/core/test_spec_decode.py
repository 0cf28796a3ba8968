"""Speculative decoding in the core: the n-gram proposer, the config, and the scheduler's half (drafts
scheduled after the known tokens, rejected ones taken back, only verified tokens hashed and cached).

The fake worker verifies drafts greedily against its deterministic model and checks every key it reads,
and the checker that every published page holds the tokens its hash names: a draft that leaked into the
cache, or a rejected position left counted, fails here.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.scheduler_sim import (
    FINE_LAYOUTS,
    LAYOUTS,
    attn,
    make_engine,
    make_request,
    mamba,
    next_token,
    step,
)
from tokenos.config import CacheConfig
from tokenos.core.request import RequestStatus
from tokenos.core.spec_decode import NgramProposer, SpeculativeConfig

DENSE = ("full", "sliding+full")
# Hybrids: the fake worker's verify pass runs the recurrence over the drafts and then commits the state
# after the kept tokens; the checker fails any published checkpoint that is not its prefix's state, and
# any step that starts from a state other than its computed tokens'.
ALL_LAYOUTS = tuple(LAYOUTS)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the largest n whose suffix occurs earlier with a follower; its latest occurrence."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.lists(st.integers(1, 6), min_size=1, max_size=5),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_ngram_proposer_is_prompt_lookup(tokens, growth, min_n, extra):
    """Incremental indexing over a growing sequence proposes what a scan from scratch finds."""
    max_n = min_n + extra
    proposer = NgramProposer(3, min_n, max_n)
    req = make_request("r", list(tokens))
    seq = req.all_token_ids
    rng = random.Random(len(tokens))
    for g in growth:
        assert proposer.propose(req, 10) == brute_force(seq, 3, min_n, max_n)
        req.append_output_token_ids([rng.randrange(5) for _ in range(g)])
    assert proposer.propose(req, 2) == brute_force(seq, 2, min_n, max_n)
    assert proposer.propose(req, 0) == []
    proposer.forget("r")
    assert proposer._index == {}


def test_mtp_config_takes_vllms_keys_and_refuses_the_others():
    config = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}')
    assert (config.num_speculative_tokens, config.lookahead_slots, config.kv_reads_next_token) == (2, 1, True)
    assert SpeculativeConfig.parse({"method": "mtp"}).num_speculative_tokens == 1  # vLLM's default
    with pytest.raises(ValueError, match="model does not apply"):
        SpeculativeConfig.parse({"method": "mtp", "model": "some/drafter", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="do not apply"):
        SpeculativeConfig.parse({"method": "mtp", "prompt_lookup_max": 3})
    assert SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3).lookahead_slots == 3
    assert SpeculativeConfig(method="ngram").lookahead_slots == 0


def test_config_takes_vllms_dict_and_refuses_what_it_does_not_build():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 5, 5)
    # vLLM 0.32's resolution of the lookup window: one bound given, the other equals it; neither, 5 and 5.
    lookups = {"prompt_lookup_min": (2, 2), "prompt_lookup_max": (5, 5)}
    for key, want in lookups.items():
        config = SpeculativeConfig.parse({"method": "ngram", key: want[0]})
        assert (config.prompt_lookup_min, config.prompt_lookup_max) == want
    config = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 4)
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="not built in tokenos"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "ngram", "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="needs a"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="a number"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": "4"})
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{method")
    suffix = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_min_token_prob": 0.2})
    # vLLM's default: the tree depth bounds the drafts, the proposer picks each one's length
    assert (suffix.num_speculative_tokens, suffix.suffix_decoding_min_token_prob) == (24, 0.2)
    with pytest.raises(ValueError, match="min_token_prob"):
        SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_min_token_prob": 1.5})


class Oracle:
    """A proposer that knows the fake model: right guesses, spoiled at a random position (or not)."""

    def __init__(self, k: int, seed: int, silent_every: int = 0) -> None:
        self.k = k
        self.rng = random.Random(seed)
        self.proposed = 0
        self.calls = 0
        self.silent_every = silent_every  # every n-th proposal is empty (a step with zero drafts)

    def propose(self, request, max_tokens: int) -> list[int]:
        self.calls += 1
        if self.silent_every and self.calls % self.silent_every == 0:
            return []
        tokens = request.all_token_ids
        drafts: list[int] = []
        for _ in range(min(self.k, max_tokens)):
            drafts.append(next_token(list(tokens) + drafts))
        if drafts and self.rng.random() < 0.6:
            drafts[self.rng.randrange(len(drafts))] = self.rng.randrange(50)
        self.proposed += len(drafts)
        return drafts

    def forget(self, request_id: str) -> None:
        pass


def run(
    layout: str, prompts: list[list[int]], spec: bool, seed: int = 0, n: int = 1, **kw
) -> dict[str, list[int]]:
    config = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=64) if spec else None
    cache = CacheConfig(block_size=4, mamba_checkpoint_at_end=layout in FINE_LAYOUTS)
    specs = LAYOUTS[layout]()
    if "num_blocks" in kw and layout not in DENSE:  # a pool that preempts, sized for every group's pages
        kw = {**kw, "num_blocks": kw["num_blocks"] * len(specs)}
    s, w, checker = make_engine(*specs, speculative_config=config, cache=cache, **kw)
    if spec:
        s.proposer = Oracle(3, seed, silent_every=(0, 2, 3)[seed % 3])
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        for k in range(n):  # n > 1: siblings fork from sample 0's pages
            fork = None if k == 0 else f"r{i}"
            rid = f"r{i}" if k == 0 else f"r{i}.{k}"
            s.add_request(make_request(rid, p, max_tokens=12, ignore_eos=True, fork_of=fork))
    steps = 0
    while s.has_unfinished_requests():
        out, outs = step(s, w, checker)
        steps += 1
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            assert len(drafts) <= 3 and rid in out.num_scheduled_tokens
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    checker.check_all_free()
    if spec:
        stats = s.make_stats()["spec_decoding"]
        assert stats["num_draft_tokens"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
        assert stats["accepted_per_pos"][0] >= stats["accepted_per_pos"][-1]
    return outputs


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize(
    "kw",
    [
        {},  # room for everything
        {"budget": 5},  # drafts cut by the budget, prompts chunked beside decodes
        {"num_blocks": 14, "max_num_seqs": 4},  # preemption by recompute mid-speculation
    ],
)
def test_speculation_changes_nothing_but_the_step_count(layout, kw):
    rng = random.Random(7)
    shared = [rng.randrange(1, 50) for _ in range(9)]
    prompts = [shared + [rng.randrange(1, 50) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    plain = run(layout, prompts, spec=False, **kw)
    assert all(len(v) == 12 for v in plain.values())
    # seed 0: every proposal has drafts; seeds 1 and 2: steps with zero drafts right after steps that
    # accepted some (vllm#52942's failure)
    for seed in range(3):
        assert run(layout, prompts, spec=True, seed=seed, **kw) == plain


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_forked_siblings_speculate_like_everyone(layout):
    rng = random.Random(8)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(5, 14))] for _ in range(3)]
    plain = run(layout, prompts, spec=False, n=3)
    assert len(plain) == 9
    for seed in range(2):
        assert run(layout, prompts, spec=True, seed=seed, n=3) == plain


def test_drafts_go_last_and_stop_rules_hold_inside_an_accepted_run():
    s, w, checker = make_engine(
        *LAYOUTS["full"](), speculative_config=SpeculativeConfig(num_speculative_tokens=4)
    )
    s.proposer = Oracle(4, 0)
    s.proposer.rng.random = lambda: 1.0  # never spoiled: every draft is accepted
    s.add_request(make_request("a", [5, 6, 7], max_tokens=3, ignore_eos=True))
    step(s, w, checker)  # the prompt, then 1 token
    req = s.requests["a"]
    drafts = list(req.spec_token_ids)
    assert len(drafts) == 1  # room for 1 draft and the token after it within max_tokens 3
    out, outs = step(s, w, checker)
    assert out.num_scheduled_tokens["a"] == 2 and out.scheduled_spec_decode_tokens["a"] == drafts
    assert outs[0].finish_reason is not None and len(outs[0].new_token_ids) == 2
    checker.check_all_free()


def test_the_budget_cuts_drafts_before_the_real_token():
    s, w, checker = make_engine(
        *LAYOUTS["full"](), budget=3, speculative_config=SpeculativeConfig(num_speculative_tokens=4)
    )
    s.proposer = Oracle(4, 1)
    s.add_request(make_request("a", [1, 2], max_tokens=20, ignore_eos=True))
    s.add_request(make_request("b", [3, 4], max_tokens=20, ignore_eos=True))
    step(s, w, checker)
    for _ in range(6):
        out, _ = step(s, w, checker)
        assert out.total_num_scheduled_tokens <= 3
        # a running request always gets its real token before anyone's drafts
        for rid in out.num_scheduled_tokens:
            assert out.num_scheduled_tokens[rid] == 1 + len(out.scheduled_spec_decode_tokens.get(rid, []))


def test_large_batches_get_no_drafts_and_grammars_cut_them():
    config = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2)
    s, w, checker = make_engine(*LAYOUTS["full"](), speculative_config=config)
    s.proposer = Oracle(2, 2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i + 1, 9], max_tokens=30, ignore_eos=True))
    step(s, w, checker)
    assert all(not r.spec_token_ids for r in s.running)  # 3 running > 2: speculation is off
    s.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    step(s, w, checker)
    assert all(r.spec_token_ids for r in s.running)

    class FirstDraftOnly:  # a grammar that would refuse every draft after the first
        takes_drafts = True

        def accept(self, token_id: int) -> bool:
            return True

        def is_terminated(self) -> bool:
            return False

        def validate(self, token_ids: list[int]) -> int:
            return min(1, len(token_ids))

    s.requests["r0"].grammar = FirstDraftOnly()
    step(s, w, checker)
    assert len(s.requests["r0"].spec_token_ids) == 1 and len(s.requests["r1"].spec_token_ids) == 2
    FirstDraftOnly.takes_drafts = False  # e.g. a reasoning gate still in the thinking
    step(s, w, checker)
    assert not s.requests["r0"].spec_token_ids and s.requests["r1"].spec_token_ids


def test_align_hybrids_cap_drafts_at_one_boundary_per_step():
    """ "align" keeps the previous and the running column: a verify step may cross one checkpoint boundary,
    so drafts are capped at block_size - 1 (an interval of 1 leaves none: refused); "all" and "none" are
    not capped."""
    config = SpeculativeConfig(num_speculative_tokens=6)
    assert make_engine(attn(8), mamba(4), speculative_config=config)[0].max_drafts == 3
    for mode in ("all", "none"):
        assert make_engine(attn(8), mamba(4, mode), speculative_config=config)[0].max_drafts == 6
    with pytest.raises(ValueError, match="no room for drafts"):
        make_engine(attn(8), mamba(1), speculative_config=config)
    s, w, checker = make_engine(attn(8), mamba(4), speculative_config=config)
    s.proposer = Oracle(6, 0)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=20, ignore_eos=True))
    for _ in range(8):
        out, _ = step(s, w, checker)
        assert all(len(d) <= 3 for d in out.scheduled_spec_decode_tokens.values())
