"""The engine core's half of "draft_model": the worker's drafts (`ModelRunnerOutput.draft_token_ids`)
become `Request.spec_token_ids` under the token-only proposers' limits, and every decoding request has its
k lookahead slots allocated for the drafter to write while it proposes.

The fake worker here drafts the fake model's next tokens (spoiled now and then) for every request that
sampled, and checks, before it drafts, that the pages for positions P .. P + k - 1 are there."""

from __future__ import annotations

import random

import pytest

from tests.fixtures.scheduler_sim import LAYOUTS, make_engine, make_request, next_token, step
from tokenos.core.spec_decode import DraftModelProposer, SpeculativeConfig

K = 3


def config(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model="drafter", num_speculative_tokens=K, **kw)


class DraftingWorker:
    """The scheduler simulation's fake worker plus a drafter that knows the fake model."""

    def __init__(self, worker, max_model_len: int, seed: int) -> None:
        self.worker = worker
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)

    def execute(self, out):
        mo = self.worker.execute(out)
        block_size = self.worker.config.kv_cache_groups[0].kv_cache_spec.block_size
        drafts = {}
        for rid, tokens in zip(mo.req_ids, mo.sampled_token_ids, strict=True):
            if not tokens:
                continue
            st = self.worker.reqs[rid]
            last = len(st.tokens) - 1
            k = min(K, self.max_model_len - last - 2)
            # The drafter writes positions last .. last + k - 1: their pages must be the request's.
            for blocks in st.block_ids:
                assert len(blocks) * block_size >= last + max(k, 0), (rid, last, len(blocks))
            d = []
            for _ in range(max(k, 0)):
                d.append(next_token(st.tokens + d))
            if d and self.rng.random() < 0.5:
                d[self.rng.randrange(len(d))] = self.rng.randrange(50)
            drafts[rid] = d
        mo.draft_token_ids = drafts
        return mo


def run(prompts, spec: bool, seed: int = 0, max_model_len: int = 64, **kw) -> dict[str, list[int]]:
    s, w, checker = make_engine(
        *LAYOUTS["full"](),
        speculative_config=config(disable_by_batch_size=64) if spec else None,
        max_model_len=max_model_len,
        **kw,
    )
    worker = DraftingWorker(w, max_model_len, seed) if spec else w
    for i, p in enumerate(prompts):
        s.add_request(make_request(f"r{i}", p, max_tokens=20, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        out, outs = step(s, worker, checker)
        for drafts in out.scheduled_spec_decode_tokens.values():
            assert 0 < len(drafts) <= K
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    checker.check_all_free()
    if spec:
        stats = s.make_stats()["spec_decoding"]
        assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    return outputs


@pytest.mark.parametrize(
    "kw", [{}, {"budget": 5}, {"num_blocks": 22, "max_num_seqs": 4}], ids=["all", "budget5", "preempt"]
)
def test_worker_drafts_change_nothing_but_the_step_count(kw):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(3, 20))] for _ in range(5)]
    plain = run(prompts, spec=False, **kw)
    for seed in range(2):
        assert run(prompts, spec=True, seed=seed, **kw) == plain


def test_lookahead_stops_at_max_model_len():
    """Prompts ending near max_model_len: the lookahead and the drafts shrink to what fits."""
    prompts = [[7] * 58, [9] * 61]
    plain = run(prompts, spec=False)
    assert run(prompts, spec=True) == plain


def test_the_proposer_hands_out_the_latest_drafts_within_the_room():
    proposer = DraftModelProposer(3)
    req = make_request("a", [1, 2, 3])
    proposer.take({"a": [4, 5, 6]})
    assert proposer.propose(req, 10) == [4, 5, 6]
    assert proposer.propose(req, 2) == [4, 5] and proposer.propose(req, 0) == []
    proposer.take({})  # the next step's: "a" was not drafted, its old drafts are stale
    assert proposer.propose(req, 10) == []


def test_config_takes_vllms_keys_for_a_draft_model():
    parsed = SpeculativeConfig.parse('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 2}')
    assert (parsed.method, parsed.model, parsed.num_speculative_tokens) == ("draft_model", "/m", 2)
    with pytest.raises(ValueError, match="required"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "ngram", "model": "/m"})
    with pytest.raises(ValueError, match="checkpoint path"):
        SpeculativeConfig.parse({"method": "draft_model", "model": 3})
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "draft_model_config": {}})
