"""The batched logits transformations, each a small function of tensors.

All work on float32 logits [num_reqs, vocab] in place where it is safe, and never loop over
tokens. Conventions follow vLLM (and through it the OpenAI API):
  repetition penalty (over prompt + output): a seen token's logit is divided by the penalty when
      positive and multiplied by it when negative;
  frequency / presence penalty (over output only): logit -= frequency * count + presence * (count > 0);
  top-k keeps the k largest logits (ties at the k-th value are kept), top-p the smallest set of
  most likely tokens whose probability reaches p (at least one), min-p the tokens whose
  probability is at least min_p times the largest;
  allowed token ids: every other logit is -inf; bad words: a word's last token is -inf when the output
      ends with the word's other tokens (always, for a one-token word).
"""

from __future__ import annotations

import torch

from tokenos.layers import cpu_kernels

NEG_INF = float("-inf")


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax ([num_reqs] int64): the first maximum, a row's first NaN where it has one.
    float32 rows take the C kernel (`cpu_kernels.argmax_rows`); others ``max(dim).indices``, which picks
    the same index as ``argmax`` and measured 2.7x faster on [64, 49152] float32 on CPU."""
    ids = cpu_kernels.argmax_rows(logits)
    return logits.max(dim=1).indices if ids is None else ids


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    rows, cols, vals = bias
    logits.index_put_((rows, cols), vals, accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Only the allowed ids of the restricted rows stay: ``allowed`` is (rows, banned [rows, vocab])."""
    rows, banned = allowed
    if rows.numel() == logits.shape[0]:  # every row restricted (rows are in order): no gather
        logits.masked_fill_(banned, NEG_INF)
    else:
        logits[rows] = logits[rows].masked_fill(banned, NEG_INF)


def bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """The last ids of the bad words whose other ids the output ends with (vLLM's rule: only generated
    tokens count, not the prompt)."""
    banned = []
    n = len(output)
    for ids in words:
        k = len(ids) - 1
        if k == 0 or (k <= n and output[n - k :] == ids[:k]):
            banned.append(ids[-1])
    return banned


def apply_token_bans(logits: torch.Tensor, bans: dict[int, list[int]]) -> None:
    """Forbid the given token ids per row (min_tokens: EOS and stop ids until enough outputs)."""
    rows = [r for r, ids in bans.items() for _ in ids]
    cols = [t for ids in bans.values() for t in ids]
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = NEG_INF


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] float32 count of each id per row from ragged lists, in one accumulate."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in token_ids]
    if sum(lengths):
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64, device=device)
        row_idx = torch.repeat_interleave(torch.arange(len(token_ids), device=device), torch.tensor(lengths))
        counts.index_put_((row_idx, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _presence_rows(padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: which ids appear in each row of a -1-padded id tensor."""
    # Pad ids all land in one extra column that is then dropped.
    padded = torch.where((padded < 0) | (padded >= vocab_size), vocab_size, padded)
    seen = torch.zeros(padded.shape[0], vocab_size + 1, dtype=torch.bool, device=padded.device)
    seen.scatter_(1, padded, True)
    return seen[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """Penalise the rows that have any penalty; the work is proportional to those rows only."""
    vocab_size = logits.shape[1]
    active = ((presence != 0) | (frequency != 0) | (repetition != 1)).nonzero().squeeze(1)
    if not active.numel():
        return
    rows = active.tolist()
    sub = logits[active]
    counts = token_counts([output_token_ids[r] for r in rows], vocab_size, logits.device)
    # Repetition first, over prompt + output; a penalty of 1 leaves a row as it is.
    seen = counts > 0
    if prompt_token_ids is not None:
        seen |= _presence_rows(prompt_token_ids[active], vocab_size)
    rep = repetition[active].unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    # Then frequency and presence, over the output only.
    sub -= frequency[active].unsqueeze(1) * counts + presence[active].unsqueeze(1) * (counts > 0)
    logits[active] = sub


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> None:
    """Keep each row's k largest logits (ties with the k-th kept). `k` >= vocab means off."""
    vocab_size = logits.shape[1]
    on = k < vocab_size
    if not bool(on.any()):
        return
    max_k = int(k[on].max())
    top_values = logits.topk(max_k, dim=1).values  # a small topk, not a sort of the vocabulary
    kth = top_values.gather(1, (k.clamp(1, max_k) - 1).unsqueeze(1))
    kth.masked_fill_(~on.unsqueeze(1), NEG_INF)
    logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, k: torch.Tensor | None = None) -> None:
    """Keep each row's smallest set of most likely tokens whose probability reaches p.

    Only rows with p < 1 are touched. When every such row already went through top-k (`k`), its
    mass lies in its top k logits, so a small topk replaces the full sort of the vocabulary.
    """
    vocab_size = logits.shape[1]
    rows = (p < 1.0).nonzero().squeeze(1)
    if not rows.numel():
        return
    sub = logits[rows]
    if k is not None and bool((k[rows] < vocab_size).all()):
        desc = sub.topk(int(k[rows].max()), dim=1).values
    else:
        desc = sub.sort(dim=1, descending=True).values
    probs = desc.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    # A token stays while the more likely ones hold less than p; the first always stays.
    num_kept = (mass_before < p[rows].unsqueeze(1)).sum(dim=1).clamp(min=1)
    threshold = desc.gather(1, (num_kept - 1).unsqueeze(1))
    logits[rows] = sub.masked_fill(sub < threshold, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, NEG_INF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row by inverting the CDF with a single uniform number per row.

    Seeded rows take their number from their own generator, so their draw depends on nothing else
    in the batch; the rest share one batched draw from the default generator. One cumsum is far
    cheaper on CPU than a vocab-sized exponential or Gumbel noise fill.
    """
    return sample_with_uniforms(probs, draw_uniforms(probs.shape[0], generators, probs.device))


def draw_uniforms(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """[num_rows, 1] uniforms in [0, 1): one batched draw from the default generator, then each seeded
    row's own number from its generator (one draw per row, in the dict's order)."""
    u = torch.rand(num_rows, 1, device=device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, device=gen.device)
    return u


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose CDF interval holds ``u`` ([rows, 1] in [0, 1]) times the row's total: the
    rows of ``probs`` need not be normalised."""
    cdf = probs.cumsum(dim=1)
    # First index whose CDF reaches u * total. Clamping u above 0 means a zero-probability token
    # (whose CDF equals its predecessor's) can never be the first to reach it.
    target = (u * cdf[:, -1:]).clamp_(min=torch.finfo(cdf.dtype).tiny)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)
