"""Logprobs of chosen tokens, their rank, and the top-n alternatives, batched.

Logprobs are of the raw model distribution (log_softmax of the logits before penalties,
temperature or truncation), vLLM's default. One topk over the batch; Python only to build the
per-row result objects.
"""

from __future__ import annotations

import torch

from tokenos.core.outputs import TokenLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: chosen token first, then its top `num_top[row]` (None: no logprobs for that row).

    rank = 1 + number of tokens strictly more likely than the chosen one.
    """
    max_top = max((n for n in num_top if n is not None), default=None)
    if max_top is None:
        return [None] * len(num_top)
    chosen = chosen.to(torch.int64).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(max_top, dim=1) if max_top > 0 else (None, None)
    chosen_ids, chosen_vals = chosen.squeeze(1).tolist(), chosen_lp.squeeze(1).tolist()
    ranks_list = ranks.tolist()
    top_ids_list = top_ids.tolist() if top_ids is not None else None
    top_lp_list = top_lp.tolist() if top_lp is not None else None
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(num_top):
        if n is None:
            out.append(None)
            continue
        ids, vals = [chosen_ids[row]], [chosen_vals[row]]
        if n > 0:
            ids += top_ids_list[row][:n]
            vals += top_lp_list[row][:n]
        out.append(TokenLogprobs(token_ids=ids, logprobs=vals, rank=ranks_list[row]))
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
