"""The persistent per-row store: add / remove / move keep every row's state with its request."""

from __future__ import annotations

import pytest
import torch

from tokenos.sample import SamplingState
from tokenos.sampling_params import SamplingParams


def test_flags_follow_the_batch() -> None:
    state = SamplingState(max_num_reqs=4, vocab_size=16)
    state.add_request(0, SamplingParams(temperature=0.0), [1], [], 2)
    md = state.make_metadata(1)
    assert md.all_greedy and md.no_penalties and md.top_k is None and md.top_p is None and md.min_p is None
    assert md.logit_bias is None and md.max_num_logprobs is None and md.generators == {}
    assert state.make_metadata(1) is md  # unchanged batch: the cached metadata

    state.add_request(1, SamplingParams(top_k=5, top_p=0.9, min_p=0.1, seed=3, logprobs=2), [1], [], 2)
    md = state.make_metadata(2)
    assert not md.all_greedy and not md.all_random
    assert md.top_k.tolist() == [16, 5] and md.top_p is not None and md.min_p is not None
    assert list(md.generators) == [1] and md.max_num_logprobs == 2 and md.num_logprobs == [None, 2]

    state.remove_request(0)
    state.move_row(1, 0)
    md = state.make_metadata(1)
    assert md.all_random and md.top_k.tolist() == [5] and list(md.generators) == [0]


def test_move_row_carries_everything() -> None:
    state = SamplingState(max_num_reqs=4, vocab_size=16)
    params = SamplingParams(
        temperature=0.5,
        top_k=3,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        min_tokens=4,
        stop_token_ids=[9],
        logit_bias={4: 1.0},
        seed=5,
        logprobs=1,
    )
    state.add_request(3, params, [7, 8], [1], 2)
    state.append_output(3, 6)
    gen = state.generators[3]
    state.move_row(3, 1)
    assert state.temperature[1] == 0.5 and state.top_k[1] == 3 and state.repetition[1] == pytest.approx(1.2)
    assert state.prompt_token_ids[1] == [7, 8] and state.output_token_ids[1] == [1, 6]
    assert state.generators[1] is gen and state.logit_bias[1] == {4: 1.0} and state.num_logprobs[1] == 1
    assert state.stop_ids[1] == [2, 9] and state.min_tokens[1] == 4
    # The source row is empty and neutral.
    assert not state.occupied[3] and state.is_greedy[3] and state.output_token_ids[3] == []
    assert state.generators[3] is None and state.repetition[3] == 1.0

    md = state.make_metadata(2)
    assert md.min_tokens == {1: [2, 9]}
    assert md.prompt_token_ids[1].tolist() == [7, 8]
    rows, cols, vals = md.logit_bias
    assert rows.tolist() == [1] and cols.tolist() == [4] and vals.tolist() == [1.0]


def test_swap_rows() -> None:
    state = SamplingState(max_num_reqs=2, vocab_size=16)
    state.add_request(0, SamplingParams(temperature=0.0), [1], [], None)
    state.add_request(1, SamplingParams(temperature=0.7, top_p=0.5), [2, 3], [4], None)
    state.swap_rows(0, 1)
    assert state.temperature.tolist()[0] == pytest.approx(0.7) and state.is_greedy == [False, True]
    assert state.top_p[0] == 0.5 and state.top_p[1] == 1.0
    assert state.prompt_token_ids == [[2, 3], [1]] and state.output_token_ids == [[4], []]


def test_preempted_request_resumes_with_its_outputs() -> None:
    state = SamplingState(max_num_reqs=2, vocab_size=16)
    state.add_request(0, SamplingParams(temperature=0.0, min_tokens=3), [1], [5, 5], 2)
    assert state.make_metadata(1).min_tokens == {0: [2]}
    state.append_output(0, 5)
    assert state.make_metadata(1).min_tokens == {}


def test_bad_rows_are_rejected() -> None:
    state = SamplingState(max_num_reqs=2, vocab_size=16)
    with pytest.raises(IndexError):
        state.add_request(2, SamplingParams(), [1], [], None)
    with pytest.raises(ValueError):
        state.make_metadata(3)


def test_empty_batch() -> None:
    state = SamplingState(max_num_reqs=2, vocab_size=16)
    md = state.make_metadata(0)
    assert md.num_reqs == 0 and md.temperature.shape == torch.Size([0])


def test_resumed_seeded_request_goes_on_with_its_draws() -> None:
    """A request resumed after a preemption with k outputs: its generator has made the k draws (one per
    sampled token) the uninterrupted request made, so the next draw is the one it would have made."""
    params = SamplingParams(temperature=1.0, seed=42)
    first = SamplingState(max_num_reqs=2, vocab_size=16)
    first.add_request(0, params, [1], [], 2)
    gen = first.generators[0]
    expected = [torch.rand(1, generator=gen).item() for _ in range(4)]
    resumed = SamplingState(max_num_reqs=2, vocab_size=16)
    resumed.add_request(1, params, [1], [5, 6, 7], 2)
    assert torch.rand(1, generator=resumed.generators[1]).item() == expected[3]
