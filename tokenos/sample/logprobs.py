"""Logprobs of chosen tokens, their rank, and the top-n alternatives, batched.

Logprobs are of the raw model distribution (log_softmax of the logits before penalties,
temperature or truncation), vLLM's default. One topk over the batch; Python only to build the
per-row result objects.
"""

from __future__ import annotations

import torch

from tokenos.core.sched.output import TokenLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: chosen token first, then its top `num_top[row]` (None: no logprobs for that row).

    rank = 1 + number of tokens strictly more likely than the chosen one. Only the rows that
    want logprobs are looked at.
    """
    wanted = [r for r, n in enumerate(num_top) if n is not None]
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not wanted:
        return out
    max_top = max(num_top[r] for r in wanted)  # type: ignore[type-var]
    if len(wanted) < len(num_top):
        index = torch.tensor(wanted, device=logprobs.device)
        logprobs, chosen = logprobs[index], chosen[index]
    chosen = chosen.to(torch.int64).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = ((logprobs > chosen_lp).sum(dim=1) + 1).tolist()
    chosen_ids, chosen_vals = chosen.squeeze(1).tolist(), chosen_lp.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in wanted]
    top_vals: list[list[float]] = [[] for _ in wanted]
    if max_top > 0:
        top = logprobs.topk(max_top, dim=1)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    for i, row in enumerate(wanted):
        n = num_top[row]
        out[row] = TokenLogprobs(
            token_ids=[chosen_ids[i], *top_ids[i][:n]],
            logprobs=[chosen_vals[i], *top_vals[i][:n]],
            rank=ranks[i],
        )
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor | list[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of prompt positions: row i of `logits` scores `target_token_ids[i]` (the next token)."""
    targets = torch.as_tensor(target_token_ids, dtype=torch.int64, device=logits.device)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {targets.shape[0]} target tokens.")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, targets, [num_top] * logits.shape[0])  # type: ignore[return-value]
