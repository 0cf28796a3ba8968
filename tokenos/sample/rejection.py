"""Speculative decoding's verification: from the logits of every draft position to the accepted drafts and
one more token per request (vLLM V1's `RejectionSampler`).

Layout: a request with drafts d_1..d_k has k + 1 consecutive logits rows, row j judging d_{j+1} and row k
giving the bonus token, requests in batch order. The metadata is `SamplingState.make_spec_metadata`'s for
the same drafts, so row j is processed exactly as plain decoding would after d_1..d_j.

Greedy requests accept a draft while it is the argmax of the processed logits and emit the argmax at the
first mismatch (or the bonus): token for token what k + 1 plain greedy steps give. Random requests use the
rejection rule of Leviathan et al. and Chen et al.: accept d with probability min(1, p(d) / q(d)), p being
what the plain sampler draws from (`Sampler.compute_probs`) and q the drafter's distribution (one-hot
where it gave none); on a rejection draw from normalize(max(p - q, 0)) and stop; when every draft is
accepted draw the bonus from p. The emitted tokens are then distributed exactly as plain sampling's.

One uniform per emitted token: the uniform that rejects a draft, rescaled to [0, 1) over the rejecting part
of its range, draws the replacement (given the rejection it is uniform, and independent of everything
before). A seeded generator thus makes one draw per token its request generated, as in plain decoding, and
a request resumed after a preemption (`SamplingState._make_generator`) goes on where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenos.core.sched.output import TokenLogprobs
from tokenos.sample import ops
from tokenos.sample.logprobs import gather_logprobs
from tokenos.sample.metadata import SamplingMetadata
from tokenos.sample.sampler import Sampler

__all__ = ["RejectionSampler", "RejectionSamplerOutput", "accept_greedy"]

# Per request: None (every draft deterministic), or its draft positions' q, each a [vocab] tensor or None
# (that draft deterministic); a [k, vocab] tensor does as well.
DraftProbs = Sequence[Sequence[torch.Tensor | None] | torch.Tensor | None]


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then exactly one more token
    logprobs: list[list[TokenLogprobs] | None]  # per request, one per emitted token; None: none wanted
    num_accepted: list[int]  # drafts accepted per request


class RejectionSampler:
    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: DraftProbs | None = None,
    ) -> RejectionSamplerOutput:
        """``logits``: [sum(k_i + 1), vocab], the rows laid out as the module docstring says; ``metadata``
        from `SamplingState.make_spec_metadata` with the same drafts; ``draft_probs``: see `DraftProbs`
        (ignored for greedy requests)."""
        drafts = [list(d) for d in draft_token_ids]
        starts = _check_layout(logits, metadata, drafts, draft_probs)
        if not drafts:
            return RejectionSamplerOutput(token_ids=[], logprobs=[], num_accepted=[])
        dev = logits.device
        md = metadata
        processed = self.sampler.processed(logits, md)
        target = ops.greedy_ids(processed) if not md.all_random else None
        if md.all_greedy:
            assert target is not None
            tokens = accept_greedy(target.tolist(), starts, drafts)
            num_accepted = [len(t) - 1 for t in tokens]
        else:
            probs = self.sampler.compute_probs(processed, md)
            flat = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64).to(dev)  # -1: bonus
            final, num_accepted = self._sample_random(probs, target, md, flat, starts, drafts, draft_probs)
            final_ids = final.tolist()
            tokens = [d[:a] + [t] for d, a, t in zip(drafts, num_accepted, final_ids, strict=True)]
        logprobs = _emitted_logprobs(logits, md, starts, tokens)
        return RejectionSamplerOutput(token_ids=tokens, logprobs=logprobs, num_accepted=num_accepted)

    @staticmethod
    def _sample_random(
        probs: torch.Tensor,
        target: torch.Tensor | None,
        md: SamplingMetadata,
        flat: torch.Tensor,
        starts: list[int],
        drafts: list[list[int]],
        draft_probs: DraftProbs | None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The drafts each request accepted and its last token (greedy ones: the argmax at their last
        row), for a batch with random requests."""
        dense_rows, dense_q = _dense_draft_probs(starts, drafts, draft_probs, probs.shape[1], probs.device)
        # Seeded requests draw one uniform per row here, and are wound back below to the draws they used.
        seeded = {i: g for i, s in enumerate(starts) if drafts[i] and (g := md.generators.get(s)) is not None}
        saved = {i: g.get_state() for i, g in seeded.items()}
        u = ops.draw_uniforms(probs.shape[0], md.generators, probs.device).squeeze(1)
        ratio = _accept_ratio(probs, flat, dense_rows, dense_q)
        accepted = u < ratio
        if target is not None:
            accepted = torch.where(md.greedy_mask, target == flat, accepted)
        num_accepted = _leading_accepts(accepted, starts, drafts)
        for i, gen in seeded.items():
            if num_accepted[i] < len(drafts[i]):
                _rewind(gen, saved[i], num_accepted[i] + 1)
        last_rows = _last_rows(starts, num_accepted, probs.device)
        rejected_at = {
            i: (starts[i] + a, d[a])
            for i, (d, a) in enumerate(zip(drafts, num_accepted, strict=True))
            if a < len(d)
        }
        drawn = _draw_last(probs[last_rows], u[last_rows], ratio[last_rows], rejected_at, dense_rows, dense_q)
        if target is None:
            return drawn, num_accepted
        return torch.where(md.greedy_mask[last_rows], target[last_rows], drawn), num_accepted


def _check_layout(
    logits: torch.Tensor,
    md: SamplingMetadata,
    drafts: list[list[int]],
    draft_probs: DraftProbs | None,
) -> list[int]:
    """Each request's first row; raises when the logits, metadata and drafts do not fit together."""
    starts = []
    total = 0
    for d in drafts:
        starts.append(total)
        total += len(d) + 1
    if logits.shape[0] != total or md.num_reqs != total:
        raise ValueError(
            f"{len(drafts)} requests with {total - len(drafts)} drafts need {total} rows: "
            f"the logits have {logits.shape[0]}, the metadata {md.num_reqs}."
        )
    if md.logitsprocs is not None:
        raise ValueError("custom logits processors cannot verify draft tokens (they follow batch rows).")
    vocab = logits.shape[1]
    if any(not 0 <= t < vocab for d in drafts for t in d):
        raise ValueError(f"a draft token is outside the vocabulary of {vocab}.")
    if draft_probs is not None and len(draft_probs) != len(drafts):
        raise ValueError(f"draft_probs has {len(draft_probs)} entries for {len(drafts)} requests.")
    return starts


def accept_greedy(targets: Sequence[int], starts: Sequence[int], drafts: list[list[int]]) -> list[list[int]]:
    """The greedy rule on each row's target (argmax) id, rows laid out as the module docstring says
    (request i's first row at starts[i]): a request's drafts while each equals its row's target, then the
    target of the first row that differs (or of the bonus row)."""
    out = []
    for s, d in zip(starts, drafts, strict=True):
        a = 0
        while a < len(d) and targets[s + a] == d[a]:
            a += 1
        out.append(d[:a] + [targets[s + a]])
    return out


def _leading_accepts(accepted: torch.Tensor, starts: list[int], drafts: list[list[int]]) -> list[int]:
    """Per request, how many of its drafts were accepted before the first rejection (bonus rows ignored)."""
    flags = accepted.tolist()
    counts = []
    for s, d in zip(starts, drafts, strict=True):
        a = 0
        while a < len(d) and flags[s + a]:
            a += 1
        counts.append(a)
    return counts


def _last_rows(starts: list[int], num_accepted: list[int], device: torch.device) -> torch.Tensor:
    """The row each request's last token comes from: the first rejected draft's, or the bonus row."""
    rows = [s + a for s, a in zip(starts, num_accepted, strict=True)]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def _dense_draft_probs(
    starts: list[int],
    drafts: list[list[int]],
    draft_probs: DraftProbs | None,
    vocab: int,
    device: torch.device,
) -> tuple[dict[int, int], torch.Tensor | None]:
    """The draft positions with a real q: row -> its index in the returned [positions, vocab] tensor."""
    if draft_probs is None:
        return {}, None
    rows: dict[int, int] = {}
    qs = []
    for i, per_req in enumerate(draft_probs):
        if per_req is None:
            continue
        if len(per_req) != len(drafts[i]):
            raise ValueError(f"request {i}: {len(per_req)} draft distributions for {len(drafts[i])} drafts.")
        for j in range(len(drafts[i])):
            q = per_req[j]
            if q is not None:
                rows[starts[i] + j] = len(qs)
                qs.append(q)
    if not qs:
        return {}, None
    stacked = torch.stack([q.to(device=device, dtype=torch.float32) for q in qs])
    if stacked.shape != (len(qs), vocab):
        raise ValueError(f"draft distributions must have {vocab} entries, got {stacked.shape[1:]}.")
    return rows, stacked


def _accept_ratio(
    probs: torch.Tensor, flat: torch.Tensor, dense_rows: dict[int, int], dense_q: torch.Tensor | None
) -> torch.Tensor:
    """min(1, p(d) / q(d)) at each draft row (q(d) = 1 for a deterministic draft), 0 at bonus rows."""
    is_draft = flat >= 0
    p_d = probs.gather(1, flat.clamp(min=0).unsqueeze(1)).squeeze(1)
    q_d = torch.ones_like(p_d)
    if dense_q is not None:
        rows = torch.tensor(list(dense_rows), dtype=torch.int64).to(probs.device)
        q_d[rows] = dense_q.gather(1, flat[rows].unsqueeze(1)).squeeze(1)
    # A draft its own q gave no mass (numerically possible) is accepted wherever p has some.
    ratio = torch.where(q_d > 0, (p_d / q_d).clamp(max=1.0), (p_d > 0).to(p_d.dtype))
    return ratio.masked_fill_(~is_draft, 0.0)


def _rewind(gen: torch.Generator, state: torch.Tensor, num_draws: int) -> None:
    """Put ``gen`` where ``num_draws`` single draws from ``state`` leave it (as plain sampling would)."""
    gen.set_state(state)
    for _ in range(num_draws):
        torch.rand(1, generator=gen, device=gen.device)


def _draw_last(
    p: torch.Tensor,
    u: torch.Tensor,
    ratio: torch.Tensor,
    rejected_at: dict[int, tuple[int, int]],
    dense_rows: dict[int, int],
    dense_q: torch.Tensor | None,
) -> torch.Tensor:
    """Each request's last token from its last row (``p``, ``u``, ``ratio``: one row per request): the
    bonus from p, or, for the requests rejected at (row, draft token), a draw from the residual with the
    uniform that rejected."""
    if rejected_at:
        dev = p.device
        rej = torch.tensor(list(rejected_at), dtype=torch.int64).to(dev)
        p[rej] = _residual(p[rej], list(rejected_at.values()), dense_rows, dense_q)
        r = ratio[rej]
        # Rejected means u >= r (so r < 1): (u - r) / (1 - r) is uniform on [0, 1) again. (A greedy
        # request's rejection is no such event, but its draw is not used.)
        u[rej] = torch.where(r < 1, (u[rej] - r) / (1 - r), 0.0).clamp_(0.0, 1.0)
    return ops.sample_with_uniforms(p, u.unsqueeze(1))


def _residual(
    p: torch.Tensor,
    rejected_at: list[tuple[int, int]],
    dense_rows: dict[int, int],
    dense_q: torch.Tensor | None,
) -> torch.Tensor:
    """max(p - q, 0) for rows of p rejected at (row, draft token), unnormalised (the draw scales by the
    total): a one-hot q just zeroes the rejected token."""
    dev = p.device
    out = p.clone()
    one_hot = [(k, tok) for k, (row, tok) in enumerate(rejected_at) if row not in dense_rows]
    dense = [(k, dense_rows[row]) for k, (row, _) in enumerate(rejected_at) if row in dense_rows]
    if one_hot:
        ks, toks = zip(*one_hot, strict=True)
        out[torch.tensor(ks).to(dev), torch.tensor(toks).to(dev)] = 0.0
    if dense:
        assert dense_q is not None
        ks, idx = zip(*dense, strict=True)
        k_index = torch.tensor(ks, dtype=torch.int64).to(dev)
        out[k_index] = (out[k_index] - dense_q[torch.tensor(idx, dtype=torch.int64).to(dev)]).clamp_(min=0.0)
    # p <= q everywhere leaves nothing to draw from: the rejection had probability 0 but for rounding.
    return torch.where(out.sum(dim=1, keepdim=True) > 0, out, p)


def _emitted_logprobs(
    logits: torch.Tensor, md: SamplingMetadata, starts: list[int], tokens: list[list[int]]
) -> list[list[TokenLogprobs] | None]:
    """Logprobs of the raw logits at the row each emitted token was chosen at, for the requests that want
    them (the request's num_logprobs, as the plain sampler reports)."""
    out: list[list[TokenLogprobs] | None] = [None] * len(tokens)
    wanted = [i for i, s in enumerate(starts) if md.num_logprobs[s] is not None]
    if not wanted:
        return out
    rows = [starts[i] + j for i in wanted for j in range(len(tokens[i]))]
    chosen = [t for i in wanted for t in tokens[i]]
    num_top = [md.num_logprobs[starts[i]] for i in wanted for _ in tokens[i]]
    dev = logits.device
    raw = torch.log_softmax(logits[torch.tensor(rows, dtype=torch.int64).to(dev)].float(), dim=-1)
    gathered = gather_logprobs(raw, torch.tensor(chosen, dtype=torch.int64).to(dev), num_top)
    pos = 0
    for i in wanted:
        n = len(tokens[i])
        out[i] = gathered[pos : pos + n]  # type: ignore[assignment]
        pos += n
    return out
