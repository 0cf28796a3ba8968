"""`RecurrentBatch`: one step's metadata for the recurrent-state layers (Mamba2, gated DeltaNet).

Idea: a step's input is one flat token stream cut into requests by ``query_start_loc``; each request owns a
fixed-size state (a checkpoint of its whole prefix) that a layer reads, advances over the request's new
tokens, and writes back in place. Prefill and decode are not modes: a request with one new token takes the
cheap recurrent step, a longer one the chunk-parallel scan, both in the same call. The batch is built once
per step by the worker and shared by every recurrent layer of one KV-cache group, so the per-request index
work (which rows, which requests decode, where checkpoints go) is done once, not per layer.

Speculative verification (``verify_reqs``): a request verifying drafts keeps the state after EVERY one of
its new tokens, produced by the same pass (it is stepped token by token, the arithmetic plain decoding
does, so the state it ends on after acceptance is the one decoding those tokens would have left). The
layers hand those states to the batch (`keep_verified`); once the rejection sampler has spoken, the
worker writes the accepted one over the running state (`tokenos.worker.recurrent.commit_verified`): a
select, never a second forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class RecurrentBatch:
    """Per-step metadata for the recurrent layers, computed once and shared by every layer.

    Args:
        query_start_loc: ``[num_reqs + 1]`` int tensor; request ``r`` owns flat tokens
            ``query_start_loc[r]:query_start_loc[r+1]`` (zero-length requests are allowed and untouched).
        has_initial_state: ``[num_reqs]`` bool; False means "start from zeros" (whatever the slot holds).
        state_indices: optional ``[num_reqs]`` int; if given, the state tensors passed to a layer are whole
            pools ``[num_slots, ...]`` and request ``r``'s state lives at row ``state_indices[r]``. If None,
            the state tensors are ``[num_reqs, ...]`` (gathered by the caller, or views).
        num_computed_tokens: optional ``[num_reqs]`` int, the number of tokens each request's state already
            summarizes (its absolute start position). Needed only to place prefix-cache checkpoints.
        checkpoint_every, checkpoint_pages: "all" cache mode: besides the running page, write the state
            after every absolute multiple ``b`` of ``checkpoint_every`` with ``n < b <= n + k`` into
            ``checkpoint_pages`` (one page per boundary, in ``checkpoint_positions`` order: by request, then
            by position). Needs ``num_computed_tokens``.
        verify_reqs: requests (with more than one new token) verifying speculative drafts: the conv and
            recurrent states after each of their new tokens are kept (``verify_positions``).
    """

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        has_initial_state: torch.Tensor,
        state_indices: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
        checkpoint_every: int | None = None,
        checkpoint_pages: torch.Tensor | None = None,
        verify_reqs: list[int] | None = None,
    ) -> None:
        qsl = [int(v) for v in query_start_loc.tolist()]
        if len(qsl) < 1 or qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:], strict=False)):
            raise ValueError(f"query_start_loc must start at 0 and be non-decreasing, got {qsl}")
        self.device = query_start_loc.device
        self.query_start_loc = qsl
        self.num_reqs = len(qsl) - 1
        self.num_tokens = qsl[-1]
        self.lengths = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
        if has_initial_state.shape != (self.num_reqs,):
            raise ValueError(f"has_initial_state must have shape ({self.num_reqs},)")
        self.has_initial_state = has_initial_state.to(device=self.device, dtype=torch.bool)
        if state_indices is None:
            self.state_rows = torch.arange(self.num_reqs, device=self.device)
        else:
            self.state_rows = state_indices.to(device=self.device, dtype=torch.long)
        self.num_computed_tokens = (
            None if num_computed_tokens is None else [int(v) for v in num_computed_tokens.tolist()]
        )
        self.verify_reqs = self._check_verify(verify_reqs or [])
        # One new token: the recurrent step. More: the chunked scan (verifying requests: token steps).
        # Zero: nothing to do.
        verifying = set(self.verify_reqs)
        self.decode_reqs = [r for r, n in enumerate(self.lengths) if n == 1]
        self.prefill_reqs = [r for r, n in enumerate(self.lengths) if n > 1 and r not in verifying]
        # (conv pool, recurrent pool, conv states, recurrent states) per layer, in verify_positions order.
        self.verified: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.decode_token_index = torch.tensor(
            [qsl[r] for r in self.decode_reqs], dtype=torch.long, device=self.device
        )
        self._conv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Per-step index work other modules derive from the batch (chunk layouts), built once.
        self.derived: dict[object, object] = {}
        # Every layer of the step reads and writes the same rows: index them once (decode steps are
        # dominated by such per-layer bookkeeping).
        self._rows: dict[tuple[int, ...] | None, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # All requests decode one token each: the conv takes its one-token path.
        self.all_decode = self.num_reqs > 0 and len(self.decode_reqs) == self.num_reqs
        self.checkpoint_every = checkpoint_every
        self.checkpoint_pages = self._check_checkpoints(checkpoint_every, checkpoint_pages)

    def _check_verify(self, reqs: list[int]) -> list[int]:
        reqs = sorted(int(r) for r in reqs)
        bad = [r for r in reqs if not 0 <= r < self.num_reqs or self.lengths[r] < 2]
        if bad or len(set(reqs)) != len(reqs):
            raise ValueError(f"verify_reqs {reqs}: each a distinct request with at least 2 new tokens")
        return reqs

    @property
    def verify_positions(self) -> list[tuple[int, int]]:
        """``(request, tokens into this step)`` after every new token of every verifying request."""
        return [(r, t) for r in self.verify_reqs for t in range(1, self.lengths[r] + 1)]

    def snapshot_positions(self, checkpoint_every: int | None) -> list[tuple[int, int]] | None:
        """Where a layer's pass keeps states: the checkpoint positions, then the verify positions (None:
        nowhere, the layer need not keep any)."""
        if checkpoint_every is None and not self.verify_reqs:
            return None
        ckpt = [] if checkpoint_every is None else self.checkpoint_positions(checkpoint_every)
        return ckpt + self.verify_positions

    def keep_verified(
        self, conv_pool: torch.Tensor, state_pool: torch.Tensor, conv: torch.Tensor, state: torch.Tensor
    ) -> None:
        """A layer's states at ``verify_positions`` (and the pools they belong in), until the commit."""
        if len(conv) != len(self.verify_positions) or len(state) != len(conv):
            raise ValueError(f"{len(conv)} verified states for {len(self.verify_positions)} positions")
        self.verified.append((conv_pool, state_pool, conv, state))

    def _check_checkpoints(self, every: int | None, pages: torch.Tensor | None) -> torch.Tensor | None:
        if (every is None) != (pages is None):
            raise ValueError("checkpoint_every and checkpoint_pages go together")
        if every is None:
            return None
        expected = len(self.checkpoint_positions(every))
        if len(pages) != expected:
            raise ValueError(f"{len(pages)} checkpoint pages for {expected} block boundaries")
        return pages.to(device=self.device, dtype=torch.long)

    def _rows_of(self, reqs: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(state rows, "has an initial state" mask or None when every request has one) of ``reqs``."""
        key = None if reqs is None or len(reqs) == self.num_reqs else tuple(reqs)
        cached = self._rows.get(key)
        if cached is None:
            if key is None:
                rows, keep = self.state_rows, self.has_initial_state
            else:
                idx = torch.tensor(key, dtype=torch.long, device=self.device)
                rows, keep = self.state_rows[idx], self.has_initial_state[idx]
            cached = self._rows[key] = (rows, None if bool(keep.all()) else keep)
        return cached

    def read_states(self, state: torch.Tensor, reqs: list[int] | None = None) -> torch.Tensor:
        """Gather the states of ``reqs`` (default all) as float32, zeros where there is no initial state."""
        idx, keep = self._rows_of(reqs)
        rows = state.index_select(0, idx).float()
        if keep is None:
            return rows
        keep = keep.view(-1, *([1] * (rows.dim() - 1)))
        return torch.where(keep, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def write_states(self, state: torch.Tensor, reqs: list[int], new: torch.Tensor) -> None:
        """Write ``new[i]`` as the state of request ``reqs[i]``, in place in ``state``."""
        if not reqs:
            return
        state.index_copy_(0, self._rows_of(reqs)[0], new.to(state.dtype))

    def checkpoint_positions(self, every: int) -> list[tuple[int, int]]:
        """``(request, tokens into this step)`` for every absolute multiple of ``every`` this step reaches."""
        if self.num_computed_tokens is None:
            raise ValueError("checkpoints need num_computed_tokens (absolute positions) in the batch")
        if every <= 0:
            raise ValueError(f"checkpoint_every must be positive, got {every}")
        out = []
        for r, (start, n) in enumerate(zip(self.num_computed_tokens, self.lengths, strict=True)):
            first = (start // every + 1) * every
            out.extend((r, pos - start) for pos in range(first, start + n + 1, every))
        return out

    def conv_rows(self, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the ``[state ; inputs]`` conv buffer: (token rows ``[T]``, state-start rows ``[R]``)."""
        if kernel_size not in self._conv_rows:
            k1 = kernel_size - 1
            lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
            req_of_token = torch.repeat_interleave(torch.arange(self.num_reqs, device=self.device), lengths)
            token_rows = torch.arange(self.num_tokens, device=self.device) + (req_of_token + 1) * k1
            qsl = torch.tensor(self.query_start_loc[:-1], dtype=torch.long, device=self.device)
            state_start = qsl + torch.arange(self.num_reqs, device=self.device) * k1
            self._conv_rows[kernel_size] = (token_rows, state_start)
        return self._conv_rows[kernel_size]


@dataclass(frozen=True)
class StateCheckpoints:
    """States after intermediate prefixes, for prefix caching: entry ``i`` is request ``req_indices[i]``'s
    state after exactly ``num_tokens[i]`` tokens (absolute, a multiple of the checkpoint granularity)."""

    req_indices: torch.Tensor
    num_tokens: torch.Tensor
    conv_states: torch.Tensor
    recurrent_states: torch.Tensor
