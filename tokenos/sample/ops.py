"""The batched logits transformations, each a small function of tensors.

All work on float32 logits [num_reqs, vocab] in place where it is safe, and never loop over
tokens. Conventions follow vLLM (and through it the OpenAI API):
  repetition penalty (over prompt + output): a seen token's logit is divided by the penalty when
      positive and multiplied by it when negative;
  frequency / presence penalty (over output only): logit -= frequency * count + presence * (count > 0);
  top-k keeps the k largest logits (ties at the k-th value are kept), top-p the smallest set of
  most likely tokens whose probability reaches p (at least one), min-p the tokens whose
  probability is at least min_p times the largest.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    rows, cols, vals = bias
    logits.index_put_((rows, cols), vals, accumulate=True)


def apply_token_bans(logits: torch.Tensor, bans: dict[int, list[int]]) -> None:
    """Forbid the given token ids per row (min_tokens: EOS and stop ids until enough outputs)."""
    rows = [r for r, ids in bans.items() for _ in ids]
    cols = [t for ids in bans.values() for t in ids]
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = NEG_INF


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab] int counts of each id per row, from ragged lists (one scatter, no loop)."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)
    for r, ids in enumerate(token_ids):
        if ids:
            padded[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return _bincount_rows(padded.to(device), vocab_size)


def _bincount_rows(padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Pad ids (>= vocab_size or < 0) all land in one extra column that is then dropped.
    padded = torch.where((padded < 0) | (padded >= vocab_size), vocab_size, padded)
    counts = torch.zeros(padded.shape[0], vocab_size + 1, dtype=torch.int64, device=padded.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    num_reqs, vocab_size = logits.shape
    output_counts = token_counts(output_token_ids[:num_reqs], vocab_size, logits.device)
    seen = output_counts > 0
    if prompt_token_ids is not None:
        seen |= _bincount_rows(prompt_token_ids, vocab_size) > 0
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency.unsqueeze(1) * output_counts + presence.unsqueeze(1) * (output_counts > 0)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> None:
    """Keep each row's k largest logits. `k` >= vocab means off for that row."""
    vocab_size = logits.shape[1]
    k = k.clamp(1, vocab_size)
    max_k = int(k.max())
    top_values = torch.topk(logits, max_k, dim=1).values
    kth = top_values.gather(1, (k - 1).unsqueeze(1))
    logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> None:
    """Keep each row's smallest set of most likely tokens whose probability reaches p."""
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=False)
    cum = sorted_logits.softmax(dim=1).cumsum(dim=1)
    # Ascending order: drop a token when everything up to and including it sums to at most 1 - p.
    drop = cum <= (1.0 - p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    logits.scatter_(1, sorted_idx, sorted_logits.masked_fill(drop, NEG_INF))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, NEG_INF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row by the exponential race: argmax(p / E), E ~ Exp(1), picks i with prob p_i.

    Seeded rows fill their noise from their own generator, so their draw is independent of the
    batch around them; the rest share one batched fill from the default generator.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=1)
