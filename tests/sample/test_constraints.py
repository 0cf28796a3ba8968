"""Allowed token ids, bad words and custom logits processors in the sampler and its per-row store: what
each allows, where each sits in the order of stages, that they follow their rows, and that a row using
none of them samples exactly what it samples without them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.fixtures.logits_processors import RecordingProcessor, TokenRuleProcessor
from tokenos.core.messages import EngineSamplingParams
from tokenos.sample import Sampler, SamplingState
from tokenos.sample.logits_processor import EngineConfig, LogitsProcessors, batch_update
from tokenos.sample.ops import bad_word_bans

VOCAB = 16
CONFIG = EngineConfig(SimpleNamespace(vocab_size=VOCAB), SimpleNamespace(max_num_seqs=8), None)


def state_of(*params: EngineSamplingParams, outputs=None, procs: LogitsProcessors | None = None):
    state = SamplingState(max_num_reqs=8, vocab_size=VOCAB, logitsprocs=procs)
    for row, p in enumerate(params):
        state.add_request(row, p, [1, 2], list(outputs[row]) if outputs else [], None)
    return state


def sample(state: SamplingState, logits: torch.Tensor, seed: int = 0) -> list[int]:
    torch.manual_seed(seed)
    return Sampler()(logits, state.make_metadata(logits.shape[0])).sampled_token_ids.tolist()


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- allowed token ids


def test_allowed_token_ids_greedy_and_random() -> None:
    logits = logits_of(2)
    allowed = [3, 9, 11]
    greedy = EngineSamplingParams(temperature=0.0, allowed_token_ids=allowed)
    best = max(allowed, key=lambda t: logits[0, t])
    assert sample(state_of(greedy, EngineSamplingParams(temperature=0.0)), logits) == [
        best,
        logits[1].argmax(),
    ]
    random_rows = [EngineSamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=s) for s in range(8)]
    drawn = sample(state_of(*random_rows), logits_of(1).expand(8, -1).clone())
    assert set(drawn) <= set(allowed)


def test_allowed_comes_before_every_other_stage() -> None:
    # A large bias on a disallowed token cannot bring it back; min_tokens bans still apply inside the set.
    params = EngineSamplingParams(temperature=0.0, allowed_token_ids=[4, 5], logit_bias={7: 100.0})
    logits = logits_of(1)
    logits[0, 4] = 50.0
    assert sample(state_of(params), logits) == [4]
    banned = EngineSamplingParams(temperature=0.0, allowed_token_ids=[4, 5], min_tokens=2, stop_token_ids=[4])
    assert sample(state_of(banned), logits) == [5]


def test_rows_without_constraints_sample_as_alone() -> None:
    logits = logits_of(4, seed=3)
    plain = [EngineSamplingParams(temperature=0.8, seed=11), EngineSamplingParams(temperature=0.0)]
    alone = [
        sample(state_of(p), logits[r : r + 1].clone(), seed=5)[0] for r, p in zip((0, 2), plain, strict=True)
    ]
    mixed = state_of(
        plain[0],
        EngineSamplingParams(temperature=1.0, allowed_token_ids=[1, 2], seed=1),
        plain[1],
        EngineSamplingParams(temperature=1.0, bad_words_token_ids=[[int(logits[3].argmax())]]),
    )
    # Rows 0 and 2 of the mixed batch hold the plain requests.
    out = sample(mixed, logits[[0, 1, 2, 3]].clone(), seed=5)
    assert [out[0], out[2]] == alone


# ---------------------------------------------------------------- bad words


def test_bad_word_bans_rule() -> None:
    words = [[5], [1, 2, 3], [2, 9]]
    assert bad_word_bans(words, []) == [5]  # a one-token word is always banned; longer ones need output
    assert bad_word_bans(words, [7, 1, 2]) == [5, 3, 9]
    assert bad_word_bans(words, [1, 2, 2]) == [5, 9]
    assert bad_word_bans(words, [2]) == [5, 9]
    assert bad_word_bans(words, [1]) == [5]  # [1, 2] is not yet the prefix [1, 2] of [1, 2, 3]


def test_bad_words_follow_the_output_and_only_the_output() -> None:
    params = EngineSamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2, 3]])
    state = SamplingState(max_num_reqs=4, vocab_size=VOCAB)
    # The prompt ends with [1, 2]: prompts do not count (vLLM), so 3 is allowed.
    state.add_request(0, params, [1, 2], [], None)
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    assert Sampler()(logits, state.make_metadata(1)).sampled_token_ids.tolist() == [3]
    md = state.make_metadata(1)
    state.append_output(0, 1)
    state.append_output(0, 2)
    again = state.make_metadata(1)
    assert again is md and again.bad_words == {0: [3]}  # cached metadata, bans refreshed from the output
    logits[0, 4] = 4.0
    assert Sampler()(logits, again).sampled_token_ids.tolist() == [4]
    # Resumed after a preemption: the replayed output gives the same ban.
    state.remove_request(0)
    state.add_request(1, params, [1, 2], [7, 1, 2], None)
    assert state.make_metadata(2).bad_words == {1: [3]}


def test_constraints_move_with_their_rows_and_the_count_stays_right() -> None:
    bad = EngineSamplingParams(bad_words_token_ids=[[6]], allowed_token_ids=[6, 7, 8])
    state = state_of(EngineSamplingParams(), bad, EngineSamplingParams(bad_words_token_ids=[[9]]))
    assert state.num_bad_words_rows == 2
    state.swap_rows(0, 1)
    md = state.make_metadata(3)
    assert md.bad_words == {0: [6], 2: [9]} and md.allowed_token_ids[0].tolist() == [0]
    state.move_row(0, 2)  # drops the request in row 2
    assert (
        state.num_bad_words_rows == 1 and state.bad_words[2] == [[6]] and state.allowed_token_ids[0] is None
    )
    state.remove_request(2)
    assert state.num_bad_words_rows == 0 and state.make_metadata(2).bad_words == {}
    one = state_of(EngineSamplingParams(), bad).make_metadata(2).select_row(1)
    assert one.bad_words == {0: [6]} and one.allowed_token_ids[0].tolist() == [0]
    assert (~one.allowed_token_ids[1][0]).nonzero().flatten().tolist() == [6, 7, 8]


def test_unused_features_cost_nothing() -> None:
    md = state_of(EngineSamplingParams(), EngineSamplingParams(temperature=0.0)).make_metadata(2)
    assert md.allowed_token_ids is None and md.bad_words == {} and md.logitsprocs is None


# ---------------------------------------------------------------- custom logits processors


def procs_of(*classes) -> LogitsProcessors:
    return LogitsProcessors(cls(CONFIG, torch.device("cpu"), False) for cls in classes)


def tell(procs: LogitsProcessors, params: list[EngineSamplingParams]) -> None:
    now = list(range(len(params)))
    procs.update_state(batch_update([], now, lambda row, index: (index, params[row], [1, 2], [])))


def test_processor_acts_on_its_rows_only_and_before_the_penalties() -> None:
    procs = procs_of(TokenRuleProcessor)
    params = [
        EngineSamplingParams(temperature=0.0),
        EngineSamplingParams(temperature=0.0, extra_args={"force_token_id": 3}, repetition_penalty=2.0),
        EngineSamplingParams(temperature=1.0, seed=4, extra_args={"ban_token_ids": list(range(1, VOCAB))}),
    ]
    tell(procs, params)
    logits = logits_of(3)
    logits[1, 3] = -1.0  # a negative logit: a penalty would multiply it, not make it the only one left
    state = state_of(*params, procs=procs)
    assert sample(state, logits.clone()) == [logits[0].argmax(), 3, 0]


def test_argmax_invariant_processors_see_random_rows_after_temperature() -> None:
    procs = procs_of(RecordingProcessor)
    (recorder,) = procs.all
    greedy = [EngineSamplingParams(temperature=0.0), EngineSamplingParams(temperature=0.0)]
    tell(procs, greedy)
    sample(state_of(*greedy, procs=procs), logits_of(2))
    assert recorder.applied == []  # an all-greedy batch never needs an argmax-invariant stage
    mixed = [EngineSamplingParams(temperature=0.0), EngineSamplingParams(temperature=0.5)]
    sample(state_of(*mixed, procs=procs), logits_of(2))
    assert len(recorder.applied) == 1 and recorder.applied[0][0] == 2
