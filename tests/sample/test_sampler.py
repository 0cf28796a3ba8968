"""The sampler against its definitions: argmax, support restriction, seeds, penalty formulas, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenos.sample import Sampler, SamplingState, compute_prompt_logprobs, ops
from tokenos.sampling_params import SamplingParams

VOCAB = 8
EOS = 7


def make_state(*params: SamplingParams, prompts=None, outputs=None, vocab: int = VOCAB) -> SamplingState:
    state = SamplingState(max_num_reqs=max(4, len(params)), vocab_size=vocab)
    for row, p in enumerate(params):
        prompt = prompts[row] if prompts else [1, 2]
        output = outputs[row] if outputs else []
        state.add_request(row, p, prompt, output, EOS)
    return state


def sample_once(state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    return Sampler()(logits, state.make_metadata(logits.shape[0])).sampled_token_ids


def draw_many(params: SamplingParams, logits_row: torch.Tensor, n: int = 400) -> torch.Tensor:
    """n independent draws of one request, done as one batch of n identical rows."""
    state = SamplingState(max_num_reqs=n, vocab_size=logits_row.shape[0])
    for row in range(n):
        state.add_request(row, params, [0], [], None)
    torch.manual_seed(0)
    return sample_once(state, logits_row.expand(n, -1).clone())


def test_greedy_is_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    state = make_state(*(SamplingParams(temperature=0.0) for _ in range(3)))
    assert state.make_metadata(3).all_greedy
    assert torch.equal(sample_once(state, logits), logits.argmax(dim=1))


def test_greedy_ids_pick_the_first_maximum_as_argmax_does() -> None:
    # Ties (coarse values, common in bf16 logits) and NaN are where a faster argmax could differ.
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(64, 512, generator=gen) * 2).round().to(dtype)
        logits[:, :40] = logits.max()  # every row ties at its first 40 columns
        logits[5, 3] = float("nan")
        logits[9, 100:200] = float("-inf")
        assert torch.equal(ops.greedy_ids(logits), logits.argmax(dim=1))
        assert ops.greedy_ids(logits)[0] == 0


def test_greedy_rows_skip_no_stage_that_edits_their_logits() -> None:
    # All-greedy batches with nothing to edit take the argmax of the caller's logits directly; any
    # editing stage (a bias, allowed ids, a penalty, min_tokens) still moves the argmax.
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.5, 0.0, 0.0, 0.0]])
    cases = [
        (SamplingParams(temperature=0.0), 1),
        (SamplingParams(temperature=0.0, logit_bias={3: 10.0}), 3),
        (SamplingParams(temperature=0.0, allowed_token_ids=[2, 4]), 2),
        (SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0), 3),
    ]
    for params, want in cases:
        state = make_state(params, outputs=[[1]])
        assert int(sample_once(state, logits.clone())[0]) == want, params


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    state = make_state(
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
    )
    md = state.make_metadata(4)
    assert not md.all_greedy and not md.all_random
    out = sample_once(state, logits)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_sampler_does_not_modify_callers_logits() -> None:
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    state = make_state(SamplingParams(repetition_penalty=2.0, top_p=0.5), SamplingParams(temperature=0.0))
    sample_once(state, logits)
    assert torch.equal(logits, before)


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, 0.0, 0.0, 0.0, 0.0])
    draws = draw_many(SamplingParams(temperature=1.0, top_k=2), logits)
    assert set(draws.tolist()) == {0, 1}


def test_top_p_restricts_support() -> None:
    # probabilities 0.5, 0.3, 0.1, 0.1: top_p=0.75 keeps {0, 1} (0.5 < 0.75 <= 0.8).
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    draws = draw_many(SamplingParams(temperature=1.0, top_p=0.75), logits)
    assert set(draws.tolist()) == {0, 1}
    frac0 = (draws == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.1  # renormalised over the kept set


def test_top_p_keeps_the_best_token_even_when_tiny() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    draws = draw_many(SamplingParams(temperature=1.0, top_p=0.01), logits, n=50)
    assert set(draws.tolist()) == {0}


def test_min_p_restricts_support() -> None:
    # min_p=0.4 with max prob 0.5: threshold 0.2 keeps tokens 0 (0.5) and 1 (0.25).
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    draws = draw_many(SamplingParams(temperature=1.0, min_p=0.4), logits)
    assert set(draws.tolist()) == {0, 1}


def test_unrestricted_sampling_matches_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = draw_many(SamplingParams(temperature=1.0), torch.log(probs), n=3000)
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.04)


def test_low_temperature_concentrates() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, 0.0])
    draws = draw_many(SamplingParams(temperature=0.05), logits, n=200)
    assert (draws == 0).all()


def _seeded_sequence(row: int, batch: int, steps: int, seed: int, fill_seed: int) -> list[int]:
    """Tokens a seeded request draws at `row` of a batch of `batch` random rows."""
    gen_logits = torch.Generator().manual_seed(123)
    torch.manual_seed(fill_seed)  # the unseeded neighbours' draws differ between runs
    state = SamplingState(max_num_reqs=batch, vocab_size=50)
    for r in range(batch):
        params = SamplingParams(temperature=1.0, seed=seed) if r == row else SamplingParams(temperature=0.9)
        state.add_request(r, params, [0], [], None)
    got = []
    for _ in range(steps):
        logits = torch.randn(batch, 50, generator=gen_logits)
        logits[row] = torch.linspace(0, 1, 50)  # the seeded row's own logits do not depend on the batch
        got.append(int(sample_once(state, logits)[row]))
    return got


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    alone = _seeded_sequence(row=0, batch=1, steps=20, seed=7, fill_seed=0)
    assert _seeded_sequence(row=2, batch=5, steps=20, seed=7, fill_seed=1) == alone
    assert _seeded_sequence(row=4, batch=6, steps=20, seed=7, fill_seed=2) == alone
    assert _seeded_sequence(row=0, batch=1, steps=20, seed=8, fill_seed=0) != alone


def test_seeded_row_survives_move_and_discarded_steps() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.linspace(0, 1, 50).expand(1, -1)
    ref = make_state(params, vocab=50)
    expected = [int(sample_once(ref, logits.clone())[0]) for _ in range(6)]

    state = SamplingState(max_num_reqs=4, vocab_size=50)
    state.add_request(3, params, [0], [], None)
    state.add_request(0, SamplingParams(temperature=1.0), [0], [], None)
    got = []
    for step in range(6):
        if step == 2:
            state.remove_request(0)
            state.move_row(3, 0)
        num = 4 if step < 2 else 1
        row = 3 if step < 2 else 0
        batch_logits = logits.expand(num, -1).clone()
        # A discarded step (as for a partial prefill) must not advance the generator.
        Sampler()(batch_logits, state.make_metadata(num, discard_rows=[row]))
        got.append(int(sample_once(state, batch_logits)[row]))
    assert got == expected


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]])
    # token 0 in the prompt, token 1 in the output: both penalised; 2 and 3 untouched.
    state = make_state(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompts=[[0]], outputs=[[1]])
    processed = logits.clone()
    Sampler.process_logits(processed, state.make_metadata(1))
    assert processed[0].tolist() == [1.0, -4.0, 2.0, -2.0, 1.0, 1.0, 1.0, 1.0]


def test_presence_and_frequency_penalty_formula() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    # The prompt does not count for presence/frequency; the output holds token 3 twice, token 4 once.
    state = make_state(params, prompts=[[5, 5, 5]], outputs=[[3, 4, 3]])
    processed = logits.clone()
    Sampler.process_logits(processed, state.make_metadata(1))
    expected = torch.zeros(VOCAB)
    expected[3] = -(0.5 + 2 * 0.25)
    expected[4] = -(0.5 + 1 * 0.25)
    assert torch.allclose(processed[0], expected)


def test_penalties_follow_appended_outputs() -> None:
    state = make_state(SamplingParams(temperature=0.0, frequency_penalty=1.0))
    md = state.make_metadata(1)
    state.append_output(0, 2)
    state.append_output(0, 2)
    assert state.make_metadata(1) is md  # nothing structural changed: cached
    processed = torch.zeros(1, VOCAB)
    Sampler.process_logits(processed, state.make_metadata(1))
    assert processed[0, 2] == -2.0 and processed[0].sum() == -2.0


def test_logit_bias() -> None:
    logits = torch.zeros(2, VOCAB)
    state = make_state(
        SamplingParams(temperature=0.0, logit_bias={5: 10.0, 1: -3.0, 999: 4.0}),
        SamplingParams(temperature=0.0),
    )
    processed = logits.clone()
    Sampler.process_logits(processed, state.make_metadata(2))
    assert processed[0, 5] == 10.0 and processed[0, 1] == -3.0 and processed[1].abs().sum() == 0
    assert sample_once(state, logits)[0] == 5


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 4] = 9.0
    logits[0, 3] = 8.0
    state = make_state(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]))
    assert sample_once(state, logits)[0] == 3
    state.append_output(0, 3)
    assert sample_once(state, logits)[0] == 3
    state.append_output(0, 3)
    assert sample_once(state, logits)[0] == EOS  # min_tokens reached


def test_min_tokens_with_ignore_eos_does_not_ban_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    state = make_state(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True))
    assert sample_once(state, logits)[0] == EOS


def test_logprobs_are_raw_log_softmax_with_rank() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    # Row 0 greedy but penalised so its choice is not the raw argmax; row 2 wants no logprobs.
    state = make_state(
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={int(logits[0].argmin()): 100.0}),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0.0),
    )
    out = Sampler()(logits, state.make_metadata(3))
    raw = torch.log_softmax(logits, dim=1)
    assert out.logprobs[2] is None
    for row, n in ((0, 3), (1, 0)):
        lp = out.logprobs[row]
        chosen = int(out.sampled_token_ids[row])
        assert lp.token_ids[0] == chosen and len(lp.token_ids) == 1 + n
        assert math.isclose(lp.logprobs[0], raw[row, chosen].item(), rel_tol=1e-5)
        order = raw[row].argsort(descending=True).tolist()
        assert lp.token_ids[1:] == order[:n]
        assert lp.rank == order.index(chosen) + 1
        assert torch.allclose(torch.tensor(lp.logprobs[1:]), raw[row, order[:n]])
    assert out.logprobs[0].rank == VOCAB  # the biased token was the raw least likely


def test_prompt_logprobs() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, VOCAB)
    targets = [3, 1, 4, 1, 5]
    result = compute_prompt_logprobs(logits, targets, num_top=2)
    raw = torch.log_softmax(logits, dim=1)
    for i, lp in enumerate(result):
        assert lp.token_ids[0] == targets[i] and len(lp.token_ids) == 3
        assert math.isclose(lp.logprobs[0], raw[i, targets[i]].item(), rel_tol=1e-5)
        assert lp.rank == int((raw[i] > raw[i, targets[i]]).sum()) + 1
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, [1, 2], num_top=1)


def test_top_k_then_top_p_in_a_mixed_batch() -> None:
    # probs 0.4 0.3 0.2 0.1 (+ zeros): top_k=3 renormalises to 4/9, 3/9, 2/9; top_p=0.6 then keeps {0, 1}.
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9]))
    n = 300
    state = SamplingState(max_num_reqs=2 * n, vocab_size=6)
    for r in range(n):
        state.add_request(r, SamplingParams(top_k=3, top_p=0.6), [0], [], None)
        state.add_request(n + r, SamplingParams(top_k=2), [0], [], None)  # top-k only
    torch.manual_seed(0)
    draws = sample_once(state, row.expand(2 * n, -1).clone())
    assert set(draws[:n].tolist()) == {0, 1} and set(draws[n:].tolist()) == {0, 1}
    state.add_request(0, SamplingParams(top_p=0.95), [0], [], None)  # a top-p row without top-k: full sort
    draws = sample_once(state, row.expand(2 * n, -1).clone())
    assert draws[0] in (0, 1, 2, 3) and set(draws[1:n].tolist()) == {0, 1}


def test_penalties_only_touch_their_rows() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    state = make_state(
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
        prompts=[[1, 2], [1, 2], [1, 2]],
        outputs=[[3, 3], [3], [4]],
    )
    processed = logits.clone()
    Sampler.process_logits(processed, state.make_metadata(3))
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    expected = logits[1].clone()
    for t in (1, 2, 3):
        expected[t] = expected[t] / 1.5 if expected[t] > 0 else expected[t] * 1.5
    expected[3] -= 1.0
    assert torch.allclose(processed[1], expected)
