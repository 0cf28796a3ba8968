"""The chunked form of a recurrent scan: prefill tokens cut into fixed-size chunks, and the driver that
advances every request's state over a step (`advance_states`).

``ChunkLayout``: the prefill tokens of a `RecurrentBatch` cut into chunks, one request never sharing a
chunk, padded with identity tokens (tokens that leave the state unchanged: zero step size / zero write
strength). With ``align=True`` each request is left-padded so chunk ends fall on absolute multiples of the
chunk size, which makes the state at those positions a free by-product of the scan (prefix-cache
checkpoints). One extra all-padding chunk at the end is the identity chunk that the per-request chunk table
points at past a request's last chunk, so the sequential inter-chunk pass needs no masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenos.layers.recurrent_batch import RecurrentBatch, StateCheckpoints


def chunk_layout(batch: RecurrentBatch, chunk_size: int, align: bool) -> ChunkLayout:
    """The batch's layout for ``chunk_size`` (built once per step, shared by every layer)."""
    key = ("chunks", chunk_size, align)
    layout = batch.derived.get(key)
    if layout is None:
        layout = batch.derived[key] = ChunkLayout.build(batch, chunk_size, align)
    return layout


def advance_states(
    batch: RecurrentBatch,
    state: torch.Tensor,
    out: torch.Tensor,
    chunk_size: int,
    checkpoint_every: int | None,
    step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scan: Callable[[ChunkLayout, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor | None:
    """Advance every request's recurrent state over its new tokens, writing outputs into ``out`` rows.

    ``step(initial [R_d, ...], token_index [R_d])`` handles one-token requests; ``scan(layout, initial
    [R_p, ...])`` the others, returning ``(rows in layout.token_src order, boundary states [R_p, chunks + 1,
    ...])``. Final states are written in place. When checkpointing, chunks are aligned to absolute multiples
    of ``gcd(chunk_size, checkpoint_every)`` so every checkpoint is a chunk boundary; returns the states at
    ``batch.snapshot_positions(checkpoint_every)`` (the checkpoints, then every position of each verifying
    request, `RecurrentBatch.verify_reqs`; None if there are none or nothing is kept).
    """
    decoded = boundary = layout = None
    if batch.decode_reqs:
        tok = batch.decode_token_index
        out[tok], decoded = step(batch.read_states(state, batch.decode_reqs), tok)
        batch.write_states(state, batch.decode_reqs, decoded)
    if batch.prefill_reqs:
        align = checkpoint_every is not None
        layout = chunk_layout(batch, math.gcd(chunk_size, checkpoint_every) if align else chunk_size, align)
        out[layout.token_src], boundary = scan(layout, batch.read_states(state, batch.prefill_reqs))
        last = torch.tensor(layout.chunks_per_req, device=state.device)
        final = boundary[torch.arange(len(last), device=state.device), last]
        batch.write_states(state, batch.prefill_reqs, final)
    verified = _step_through(batch, state, out, step) if batch.verify_reqs else None
    positions = batch.snapshot_positions(checkpoint_every)
    if positions is None:
        return None
    # A decode request's only reachable state is its new one; a prefill request's are chunk boundaries;
    # a verifying request's are all of its positions.
    decode_pos = {r: i for i, r in enumerate(batch.decode_reqs)}
    prefill_pos = {r: i for i, r in enumerate(batch.prefill_reqs)}
    verify_pos = {pos: i for i, pos in enumerate(batch.verify_positions)}
    picked = []
    for r, n in positions:
        if r in decode_pos:
            picked.append(decoded[decode_pos[r]])
        elif r in prefill_pos:
            p = prefill_pos[r]
            picked.append(boundary[p, layout.chunk_of(p, n) + 1])
        else:
            picked.append(verified[verify_pos[r, n]])
    return torch.stack(picked) if picked else None


def _step_through(
    batch: RecurrentBatch,
    state: torch.Tensor,
    out: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Advance the verifying requests one token at a time (all of them together at each offset), keeping
    the state after every token: ``[len(batch.verify_positions), ...]``, final states written in place.

    Token steps rather than a scan: the states after every position are what a scan with chunks of one
    would give, and the step is exactly plain decoding's arithmetic, so an accepted prefix leaves the
    state decoding it would have (speculation changes no rounding of the recurrent state)."""
    reqs = batch.verify_reqs
    starts = [batch.query_start_loc[r] for r in reqs]
    lengths = [batch.lengths[r] for r in reqs]
    current = batch.read_states(state, reqs)
    kept: list[list[torch.Tensor]] = [[] for _ in reqs]
    for t in range(max(lengths)):
        active = [i for i, n in enumerate(lengths) if n > t]
        rows = torch.tensor(active, dtype=torch.long, device=state.device)
        tok = torch.tensor([starts[i] + t for i in active], dtype=torch.long, device=state.device)
        out[tok], new = step(current.index_select(0, rows), tok)
        current = current.index_copy(0, rows, new)
        for k, i in enumerate(active):
            kept[i].append(new[k])
    batch.write_states(state, reqs, current)
    return torch.stack([s for per_req in kept for s in per_req])


def make_checkpoints(
    batch: RecurrentBatch,
    positions: list[tuple[int, int]],
    conv_states: torch.Tensor | None,
    recurrent_states: torch.Tensor | None,
) -> StateCheckpoints:
    """Package the states at ``positions`` (``(request, tokens into this step)``) with absolute lengths."""
    req = torch.tensor([r for r, _ in positions], dtype=torch.long)
    num = torch.tensor([batch.num_computed_tokens[r] + n for r, n in positions], dtype=torch.long)
    if not positions:
        empty = torch.zeros(0)
        return StateCheckpoints(req, num, empty, empty)
    return StateCheckpoints(req, num, conv_states, recurrent_states)


@dataclass(frozen=True)
class ChunkLayout:
    """Prefill tokens of a ``RecurrentBatch`` scattered into ``[num_chunks + 1, chunk_size]`` slots.

    ``token_src[i]`` (a flat token index) sits at flat slot ``token_slot[i]``; request ``prefill_reqs[p]``
    owns chunks ``chunk_table[p, :n_p]``, and ``chunk_table[p, j >= n_p]`` is the identity chunk (the
    last one). ``left_pad[p]`` identity tokens precede the request's first token.
    """

    chunk_size: int
    num_chunks: int
    token_src: torch.Tensor
    token_slot: torch.Tensor
    chunk_table: torch.Tensor
    chunks_per_req: list[int]
    left_pad: list[int]

    @staticmethod
    def build(batch: RecurrentBatch, chunk_size: int, align: bool) -> ChunkLayout:
        if align and batch.num_computed_tokens is None:
            raise ValueError("aligned chunks need num_computed_tokens in the RecurrentBatch")
        src, slot, counts, pads = [], [], [], []
        first = 0
        for r in batch.prefill_reqs:
            n = batch.lengths[r]
            pad = batch.num_computed_tokens[r] % chunk_size if align else 0
            start = batch.query_start_loc[r]
            src.append(torch.arange(start, start + n))
            slot.append(torch.arange(n) + first * chunk_size + pad)
            count = math.ceil((pad + n) / chunk_size)
            counts.append(count)
            pads.append(pad)
            first += count
        max_chunks = max(counts, default=0)
        table = torch.full((len(counts), max_chunks), first, dtype=torch.long)
        offset = 0
        for p, count in enumerate(counts):
            table[p, :count] = torch.arange(offset, offset + count)
            offset += count
        dev = batch.device
        empty = torch.zeros(0, dtype=torch.long)
        return ChunkLayout(
            chunk_size=chunk_size,
            num_chunks=first,
            token_src=torch.cat(src).to(dev) if src else empty.to(dev),
            token_slot=torch.cat(slot).to(dev) if slot else empty.to(dev),
            chunk_table=table.to(dev),
            chunks_per_req=counts,
            left_pad=pads,
        )

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, *rest]`` -> ``[num_chunks + 1, chunk_size, *rest]`` float32, identity-padded."""
        buf = x.new_zeros(((self.num_chunks + 1) * self.chunk_size, *x.shape[1:]), dtype=torch.float32)
        buf[self.token_slot] = x[self.token_src].float()
        return buf.view(self.num_chunks + 1, self.chunk_size, *x.shape[1:])

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[num_chunks + 1, chunk_size, *rest]`` -> ``[num_prefill_tokens, *rest]``, ``token_src`` order."""
        return y.reshape(-1, *y.shape[2:])[self.token_slot]

    def chunk_start_states(self, boundary: torch.Tensor) -> torch.Tensor:
        """Boundary states ``[num_prefill, max_chunks + 1, ...]`` -> the state at the start of every chunk,
        ``[num_chunks + 1, ...]`` (zeros for the identity chunk). Requests' chunks are numbered in order."""
        parts = [boundary[p, :n] for p, n in enumerate(self.chunks_per_req)]
        parts.append(boundary.new_zeros((1, *boundary.shape[2:])))
        return torch.cat(parts)

    def chunk_of(self, p: int, tokens_in: int) -> int:
        """Index ``j`` (into ``chunk_table[p]``) of the chunk ending right after ``tokens_in`` new tokens.

        Only meaningful when ``left_pad[p] + tokens_in`` is a multiple of the chunk size or the request's end.
        """
        return math.ceil((self.left_pad[p] + tokens_in) / self.chunk_size) - 1
