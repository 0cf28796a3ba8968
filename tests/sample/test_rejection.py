"""Draft verification against its definitions: the spec metadata's virtual rows are plain rows with the
drafts appended, greedy verification is plain greedy decoding token for token, random verification emits
tokens distributed exactly as plain sampling's, seeded requests reproduce, and no drafts is plain sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenos.core.messages import EngineSamplingParams
from tokenos.sample import Sampler, SamplingState
from tokenos.sample.rejection import RejectionSampler

VOCAB = 12
EOS = 11
PROMPT = [1, 2, 3]


def state_of(
    params: list[EngineSamplingParams], outputs: list[list[int]], vocab: int = VOCAB
) -> SamplingState:
    state = SamplingState(max_num_reqs=max(4, len(params)), vocab_size=vocab)
    for row, (p, out) in enumerate(zip(params, outputs, strict=True)):
        state.add_request(row, p, PROMPT, out, EOS, stop_token_ids=[10])
    return state


def verify(state: SamplingState, logits: torch.Tensor, drafts: list[list[int]], draft_probs=None):
    md = state.make_spec_metadata(len(drafts), drafts)
    return RejectionSampler(Sampler())(logits, md, drafts, draft_probs)


def starts_of(drafts: list[list[int]]) -> list[int]:
    starts, total = [], 0
    for d in drafts:
        starts.append(total)
        total += len(d) + 1
    return starts


def plain_steps(
    params: EngineSamplingParams, outputs: list[int], rows: torch.Tensor, drafts: list[int] | None = None
):
    """Plain decoding of one request, one row of ``rows`` per step, going on while it emits the drafts
    (None: through every row)."""
    state = state_of([params], [outputs])
    tokens, logprobs = [], []
    for j in range(rows.shape[0]):
        out = Sampler()(rows[j : j + 1].clone(), state.make_metadata(1))
        tokens.append(int(out.sampled_token_ids[0]))
        logprobs.append(out.logprobs[0])
        if drafts is not None and (j == len(drafts) or tokens[-1] != drafts[j]):
            break
        state.append_output(0, tokens[-1])
    return tokens, logprobs


# ---------------------------------------------------------------- the virtual rows


token = st.integers(0, VOCAB - 1)


@st.composite
def request_params(draw, greedy: bool | None = None) -> EngineSamplingParams:
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    return EngineSamplingParams(
        temperature=0.0 if is_greedy else draw(st.sampled_from([0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, 3, 7])),
        top_p=draw(st.sampled_from([1.0, 0.8])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        presence_penalty=draw(st.sampled_from([0.0, 0.7])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.4])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.6])),
        min_tokens=draw(st.integers(0, 5)),
        logit_bias=draw(st.none() | st.dictionaries(token, st.floats(-3.0, 3.0), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(token, min_size=2, max_size=8)),
        bad_words_token_ids=draw(st.none() | st.lists(st.lists(token, min_size=1, max_size=3), max_size=3)),
        logprobs=draw(st.sampled_from([None, 0, 2])),
    )


@st.composite
def batches(draw, greedy: bool | None = None):
    n = draw(st.integers(1, 4))
    params = [draw(request_params(greedy)) for _ in range(n)]
    outputs = [draw(st.lists(token, max_size=3)) for _ in range(n)]
    drafts = [draw(st.lists(token, max_size=4)) for _ in range(n)]
    seed = draw(st.integers(0, 2**16))
    return params, outputs, drafts, seed


def logits_for(drafts: list[list[int]], seed: int) -> torch.Tensor:
    rows = sum(len(d) + 1 for d in drafts)
    return 2.0 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_virtual_rows_are_plain_rows_with_the_drafts_appended(batch) -> None:
    params, outputs, drafts, seed = batch
    state = state_of(params, outputs)
    plain = state.make_metadata(len(params))
    live = [list(o) for o in state.output_token_ids[: len(params)]]
    md = state.make_spec_metadata(len(params), drafts)
    logits = logits_for(drafts, seed)
    processed = Sampler.process_logits(logits.clone(), md)
    probs = Sampler.compute_probs(processed.clone(), md)
    for i, start in enumerate(starts_of(drafts)):
        for j in range(len(drafts[i]) + 1):
            v = start + j
            ref_state = state_of([params[i]], [outputs[i] + drafts[i][:j]])
            ref = ref_state.make_metadata(1)
            ref_processed = Sampler.process_logits(logits[v : v + 1].clone(), ref)
            assert torch.equal(processed[v : v + 1], ref_processed), (i, j)
            if params[i].temperature > 0:  # a greedy row's probs are unused (and depend on its batch)
                ref_probs = Sampler.compute_probs(ref_processed, ref)
                assert torch.allclose(probs[v : v + 1], ref_probs, atol=1e-6, equal_nan=True), (i, j)
            assert md.num_logprobs[v] == params[i].logprobs
            assert bool(md.greedy_mask[v]) == (params[i].temperature == 0.0)
    # The plain step's cached metadata and the live outputs are as they were.
    assert state.make_metadata(len(params)) is plain
    assert state.output_token_ids[: len(params)] == live


def test_seeded_virtual_rows_share_the_generator_and_discarded_rows_have_none() -> None:
    params = [
        EngineSamplingParams(seed=3),
        EngineSamplingParams(temperature=0.0, seed=4),
        EngineSamplingParams(),
    ]
    state = state_of(params, [[], [], []])
    md = state.make_spec_metadata(3, [[1, 2], [3], []])
    assert md.num_reqs == 6 and md.logitsprocs is None
    assert list(md.generators) == [0, 1, 2] and all(g is state.generators[0] for g in md.generators.values())
    assert state.make_spec_metadata(3, [[1, 2], [3], []], discard_rows=[0]).generators == {}
    with pytest.raises(ValueError):
        state.make_spec_metadata(3, [[1]])


# ---------------------------------------------------------------- greedy


@settings(max_examples=80, deadline=None)
@given(batches(greedy=True), st.data())
def test_greedy_verification_is_plain_greedy_decoding(batch, data) -> None:
    params, outputs, drafts, seed = batch
    logits = logits_for(drafts, seed)
    starts = starts_of(drafts)
    # Drafts that follow plain greedy decoding up to a point (random ones are almost all rejected at once).
    for i, start in enumerate(starts):
        k = len(drafts[i])
        chain, _ = plain_steps(params[i], outputs[i], logits[start : start + k])
        cut = data.draw(st.integers(0, k))
        drafts[i] = chain[:cut] + drafts[i][cut:]
    # A random neighbour must change nothing for the greedy requests.
    params.append(EngineSamplingParams(temperature=1.0))
    outputs.append([])
    drafts.append([4, 5])
    logits = torch.cat([logits, torch.randn(3, VOCAB)])
    out = verify(state_of(params, outputs), logits, drafts)
    for i, start in enumerate(starts):
        k = len(drafts[i])
        tokens, logprobs = plain_steps(params[i], outputs[i], logits[start : start + k + 1], drafts[i])
        assert out.token_ids[i] == tokens
        assert out.num_accepted[i] == len(tokens) - 1
        if params[i].logprobs is None:
            assert out.logprobs[i] is None
            continue
        assert len(out.logprobs[i]) == len(tokens)
        for got, want in zip(out.logprobs[i], logprobs, strict=True):
            assert got.token_ids == want.token_ids and got.rank == want.rank
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert len(out.token_ids[-1]) in (1, 2, 3) and out.logprobs[-1] is None


def test_greedy_accepts_all_then_the_bonus() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, tok in enumerate([5, 6, 7, 8]):
        logits[row, tok] = 3.0
    params = [EngineSamplingParams(temperature=0.0)]
    out = verify(state_of(params, [[]]), logits, [[5, 6, 7]])
    assert out.token_ids == [[5, 6, 7, 8]] and out.num_accepted == [3]
    out = verify(state_of(params, [[]]), logits, [[5, 9, 7]])
    assert out.token_ids == [[5, 6]] and out.num_accepted == [1]


def test_greedy_verification_edits_only_through_a_stage_that_edits() -> None:
    # All-greedy batches with nothing to edit take the argmax of the caller's logits (no copy); a bias
    # still moves it, and the caller's logits stay as they were either way.
    logits = torch.full((2, VOCAB), -1.0)
    logits[0, 5], logits[1, 6], logits[1, 4] = 3.0, 3.0, 2.5
    before = logits.clone()
    plain = [EngineSamplingParams(temperature=0.0)]
    assert verify(state_of(plain, [[]]), logits, [[5]]).token_ids == [[5, 6]]
    biased = [EngineSamplingParams(temperature=0.0, logit_bias={4: 1.0})]
    assert verify(state_of(biased, [[]]), logits, [[5]]).token_ids == [[5, 4]]
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- random: the emitted distribution


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the samples against p; any sample outside p's support is infinite."""
    counts = torch.bincount(samples, minlength=p.numel()).double()
    support = p > 0
    if counts[~support].sum() > 0:
        return math.inf
    expected = p[support].double() * samples.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum())


# Far above any chance value with 7 degrees of freedom (p < 1e-6 at 36), far below what a wrong rule gives
# at these sample sizes; the seeds are fixed, so the outcome is too.
CHI2_LIMIT = 40.0
TRIALS = 20_000
V = 8
TARGET_LOGITS = torch.log(
    torch.tensor(
        [
            [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02],
            [0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.15, 0.05],
            [0.12, 0.12, 0.12, 0.12, 0.13, 0.13, 0.13, 0.13],
        ]
    )
)
# The drafter's q, and where one-hot drafts are drawn from: mostly p's modes (so that many are accepted and
# the later positions get samples), with some mass off p's support (top-k drops tokens 6 and 7 at row 0).
DRAFT_Q = torch.tensor(
    [
        [0.05, 0.05, 0.10, 0.10, 0.10, 0.10, 0.20, 0.30],
        [0.10, 0.30, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)
DRAFT_R = torch.tensor(
    [
        [0.60, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05],
        [0.05, 0.05, 0.65, 0.05, 0.05, 0.05, 0.05, 0.05],
    ]
)


def target_p(temperature: float, top_k: int) -> torch.Tensor:
    """What plain sampling draws from at each of the three positions, computed by hand."""
    probs = (TARGET_LOGITS / temperature).softmax(dim=1)
    kth = probs.topk(top_k, dim=1).values[:, -1:]
    probs = torch.where(probs >= kth, probs, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot", "draft-probs"])
def test_random_verification_emits_the_target_distribution(with_q: bool) -> None:
    temperature, top_k = 0.9, 6
    params = EngineSamplingParams(temperature=temperature, top_k=top_k)
    state = SamplingState(max_num_reqs=TRIALS, vocab_size=V)
    for row in range(TRIALS):
        state.add_request(row, params, [0], [], None)
    gen = torch.Generator().manual_seed(1234)
    # With q the drafts must be drawn from it; one-hot drafts may come from anywhere.
    source = DRAFT_Q if with_q else DRAFT_R
    drafts = torch.multinomial(source, TRIALS, replacement=True, generator=gen).T.tolist()
    draft_probs = [DRAFT_Q] * TRIALS if with_q else None
    logits = TARGET_LOGITS.repeat(TRIALS, 1)
    torch.manual_seed(99)
    out = verify(state, logits, drafts, draft_probs)
    p = target_p(temperature, top_k)

    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square(first, p[0]) < CHI2_LIMIT
    accepted = torch.tensor(out.num_accepted)
    second = torch.tensor([t[1] for t, a in zip(out.token_ids, out.num_accepted, strict=True) if a >= 1])
    assert chi_square(second, p[1]) < CHI2_LIMIT
    third = torch.tensor([t[2] for t, a in zip(out.token_ids, out.num_accepted, strict=True) if a == 2])
    assert chi_square(third, p[2]) < CHI2_LIMIT
    # The acceptance rate is the rule's: sum of min(p, q) (for one-hot drafts: the mean p(d) over them).
    expected_rate = torch.minimum(p[0], DRAFT_Q[0]).sum() if with_q else (p[0] * DRAFT_R[0]).sum()
    assert abs(float((accepted >= 1).double().mean()) - float(expected_rate)) < 0.015
    assert all(len(t) == a + 1 for t, a in zip(out.token_ids, out.num_accepted, strict=True))
    assert all(t[:a] == d[:a] for t, a, d in zip(out.token_ids, out.num_accepted, drafts, strict=True))


def test_the_chi_square_check_catches_a_wrong_rule() -> None:
    """Emitting the accepted-or-resampled token of a rule that ignores q would fail the same check."""
    p = target_p(0.9, 6)
    gen = torch.Generator().manual_seed(5)
    wrong = torch.multinomial((p[0] + DRAFT_Q[0]) / 2, TRIALS, replacement=True, generator=gen)
    assert chi_square(wrong, p[0]) > 10 * CHI2_LIMIT


# ---------------------------------------------------------------- seeds and no drafts


def seeded_run(fill_seed: int, steps: int = 5):
    """A seeded request verified over several steps next to unseeded neighbours; its tokens and generator."""
    params = [EngineSamplingParams(temperature=1.0), EngineSamplingParams(temperature=1.1, seed=21)]
    params.append(EngineSamplingParams(temperature=0.7))
    state = state_of(params, [[], [], []])
    torch.manual_seed(fill_seed)  # the neighbours' draws differ between runs
    logits_gen = torch.Generator().manual_seed(8)
    got = []
    for step in range(steps):
        drafts = [[1, 2], [step % VOCAB, 3, 4], [5]]
        logits = torch.randn(9, VOCAB, generator=logits_gen)
        logits[3:7] = torch.linspace(0, 2, VOCAB)  # the seeded request's rows
        out = verify(state, logits, drafts)
        for row, tokens in enumerate(out.token_ids):
            for t in tokens:
                state.append_output(row, t)
        got.append(out.token_ids[1])
    return got, state


def test_seeded_requests_reproduce_and_draw_once_per_token() -> None:
    tokens, state = seeded_run(fill_seed=0)
    again, _ = seeded_run(fill_seed=1)
    assert again == tokens
    # One draw per emitted token: a request resumed after a preemption with these outputs has the same
    # generator state, so it goes on with the same draws.
    resumed = SamplingState(max_num_reqs=1, vocab_size=VOCAB)
    resumed.add_request(
        0, EngineSamplingParams(temperature=1.1, seed=21), PROMPT, state.output_token_ids[1], EOS
    )
    assert sum(len(t) for t in tokens) == len(state.output_token_ids[1])
    assert torch.equal(resumed.generators[0].get_state(), state.generators[1].get_state())


def test_no_drafts_is_plain_sampling() -> None:
    params = [
        EngineSamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        EngineSamplingParams(temperature=0.8, top_k=5, seed=7, logprobs=1),
        EngineSamplingParams(temperature=1.2, top_p=0.9, presence_penalty=0.5),
        EngineSamplingParams(temperature=1.0, min_p=0.05, seed=8, min_tokens=2),
    ]
    outputs = [[4], [], [3, 3], []]
    plain, spec = state_of(params, outputs), state_of(params, outputs)
    logits_gen = torch.Generator().manual_seed(2)
    for step in range(6):
        logits = torch.randn(4, VOCAB, generator=logits_gen)
        torch.manual_seed(step)
        want = Sampler()(logits, plain.make_metadata(4))
        torch.manual_seed(step)
        got = verify(spec, logits, [[], [], [], []])
        assert got.token_ids == [[t] for t in want.sampled_token_ids.tolist()] and got.num_accepted == [0] * 4
        for lp, ref in zip(got.logprobs, want.logprobs, strict=True):
            assert (lp is None) == (ref is None)
            if ref is not None:
                assert lp[0].token_ids == ref.token_ids and lp[0].logprobs == pytest.approx(ref.logprobs)
        for row, tokens in enumerate(got.token_ids):
            plain.append_output(row, tokens[0])
            spec.append_output(row, tokens[0])
    for row in (1, 3):
        assert torch.equal(plain.generators[row].get_state(), spec.generators[row].get_state())


def test_layout_mismatches_are_refused() -> None:
    state = state_of([EngineSamplingParams(temperature=0.0)], [[]])
    md = state.make_spec_metadata(1, [[1, 2]])
    with pytest.raises(ValueError):
        RejectionSampler()(torch.zeros(2, VOCAB), md, [[1, 2]])
    with pytest.raises(ValueError):
        RejectionSampler()(torch.zeros(3, VOCAB), md, [[1, VOCAB]])
    assert RejectionSampler()(torch.zeros(0, VOCAB), state.make_spec_metadata(0, []), []).token_ids == []
