"""Shared machinery of the recurrent-state layers (Mamba2, gated DeltaNet): the batch, the short conv, chunks.

Idea: a step's input is one flat token stream cut into requests by ``query_start_loc``; each request owns a
fixed-size state (a checkpoint of its whole prefix) that the layer reads, advances over the request's new
tokens, and writes back in place. Prefill and decode are not modes: a request with one new token takes the
cheap recurrent step, a longer one the chunk-parallel scan, both in the same call.

Four pieces live here because both layer families need them:

- ``RecurrentBatch``: per-step metadata (lengths, which requests decode, where states live), built once
  by the worker and shared by every recurrent layer of the step.
- ``causal_conv1d_varlen``: the depthwise causal conv with a ROLLING state, the last ``K - 1`` inputs.
  Each request's rows are laid out as ``[state ; new inputs]`` in one buffer, so the conv of any split of a
  sequence equals the conv of the whole sequence, and the state after any prefix is a slice of that buffer.
- ``ChunkLayout``: the prefill tokens cut into fixed-size chunks, one request never sharing a chunk, padded
  with identity tokens (tokens that leave the state unchanged: zero step size / zero write strength). With
  ``align=True`` each request is left-padded so chunk ends fall on absolute multiples of the chunk size,
  which makes the state at those positions a free by-product of the scan (prefix-cache checkpoints).
  One extra all-padding chunk at the end is the identity chunk that the per-request chunk table points at
  past a request's last chunk, so the sequential inter-chunk pass needs no masks.

- ``RecurrentLayer``: the base both layers share: dims from a config, state shapes, ``forward`` and
  ``forward_with_checkpoints`` over one ``_run``, ``load_weights``.

Plus the small weight helpers both layers use: parameters named exactly as in the HF checkpoint, each
with a ``weight_loader``, so a layer's ``load_weights`` is a name lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
    """

    def __init__(
        self,
        query_start_loc: torch.Tensor,
        has_initial_state: torch.Tensor,
        state_indices: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
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
        self.num_computed_tokens = None if num_computed_tokens is None else [
            int(v) for v in num_computed_tokens.tolist()
        ]
        # One new token: the recurrent step. More: the chunked scan. Zero: nothing to do.
        self.decode_reqs = [r for r, n in enumerate(self.lengths) if n == 1]
        self.prefill_reqs = [r for r, n in enumerate(self.lengths) if n > 1]
        self.decode_token_index = torch.tensor([qsl[r] for r in self.decode_reqs], dtype=torch.long,
                                               device=self.device)
        self._conv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._chunk_layouts: dict[tuple[int, bool], ChunkLayout] = {}
        # Every layer of the step reads and writes the same rows: index them once (decode steps are
        # dominated by such per-layer bookkeeping).
        self._rows: dict[tuple[int, ...] | None, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # All requests decode one token each: the conv takes its one-token path.
        self.all_decode = self.num_reqs > 0 and len(self.decode_reqs) == self.num_reqs

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

    def chunk_layout(self, chunk_size: int, align: bool) -> ChunkLayout:
        key = (chunk_size, align)
        if key not in self._chunk_layouts:
            self._chunk_layouts[key] = ChunkLayout.build(self, chunk_size, align)
        return self._chunk_layouts[key]


@dataclass(frozen=True)
class StateCheckpoints:
    """States after intermediate prefixes, for prefix caching: entry ``i`` is request ``req_indices[i]``'s
    state after exactly ``num_tokens[i]`` tokens (absolute, a multiple of the checkpoint granularity)."""

    req_indices: torch.Tensor
    num_tokens: torch.Tensor
    conv_states: torch.Tensor
    recurrent_states: torch.Tensor


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
    ``batch.checkpoint_positions(checkpoint_every)`` (None if there are none or no checkpointing).
    """
    decoded = boundary = layout = None
    if batch.decode_reqs:
        tok = batch.decode_token_index
        out[tok], decoded = step(batch.read_states(state, batch.decode_reqs), tok)
        batch.write_states(state, batch.decode_reqs, decoded)
    if batch.prefill_reqs:
        align = checkpoint_every is not None
        layout = batch.chunk_layout(math.gcd(chunk_size, checkpoint_every) if align else chunk_size, align)
        out[layout.token_src], boundary = scan(layout, batch.read_states(state, batch.prefill_reqs))
        last = torch.tensor(layout.chunks_per_req, device=state.device)
        final = boundary[torch.arange(len(last), device=state.device), last]
        batch.write_states(state, batch.prefill_reqs, final)
    if checkpoint_every is None:
        return None
    # A decode request's only reachable state is its new one; a prefill request's are chunk boundaries.
    decode_pos = {r: i for i, r in enumerate(batch.decode_reqs)}
    prefill_pos = {r: i for i, r in enumerate(batch.prefill_reqs)}
    picked = []
    for r, n in batch.checkpoint_positions(checkpoint_every):
        if r in decode_pos:
            picked.append(decoded[decode_pos[r]])
        else:
            p = prefill_pos[r]
            picked.append(boundary[p, layout.chunk_of(p, n) + 1])
    return torch.stack(picked) if picked else None


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


def _conv1d_one_token(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """``causal_conv1d_varlen`` when every request brings exactly one token (x row r is request r)."""
    window = torch.cat([batch.read_states(conv_state), x.float()[:, None]], dim=1)  # [R, K, C]
    out = (window * weight.float().T).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    batch.write_states(conv_state, batch.decode_reqs, window[:, 1:])
    if x.dtype != torch.float32:
        out = out.to(x.dtype).float()  # round before the activation, as in the general path
    return F.silu(out)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: RecurrentBatch,
    snapshots: list[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv1d + SiLU over a varlen batch with a rolling state, updated in place.

    Args:
        x: ``[num_tokens, channels]`` conv inputs.
        weight: ``[channels, K]`` (the HF ``conv1d.weight`` squeezed).
        conv_state: ``[num_reqs or num_slots, K - 1, channels]``: the last ``K - 1`` inputs before the step.
        snapshots: optional ``(request, n)`` pairs; returns the conv state after the first ``n`` new tokens.
    Returns:
        ``(silu(conv(x)) [num_tokens, channels] float32, snapshot states [M, K - 1, channels] or None)``.
    """
    k = weight.shape[1]
    k1 = k - 1
    if batch.all_decode and snapshots is None and k1 > 0:
        return _conv1d_one_token(x, weight, bias, conv_state, batch), None
    token_rows, state_start = batch.conv_rows(k)
    channels = x.shape[1]
    ext = x.new_empty((batch.num_tokens + batch.num_reqs * k1, channels), dtype=torch.float32)
    window = torch.arange(k1, device=x.device)
    if k1 > 0:
        ext[(state_start[:, None] + window).reshape(-1)] = batch.read_states(conv_state).reshape(-1, channels)
    ext[token_rows] = x.float()
    # out[t] = sum_j w[:, j] * input[t - (K-1) + j]; K is tiny, so K gathers beat materializing windows.
    w = weight.float()
    out = ext[token_rows - k1] * w[:, 0]
    for j in range(1, k):
        out = out + ext[token_rows - k1 + j] * w[:, j]
    if bias is not None:
        out = out + bias.float()
    lengths = torch.tensor(batch.lengths, dtype=torch.long, device=x.device)
    new_state = ext[state_start[:, None] + lengths[:, None] + window]
    done = [r for r, n in enumerate(batch.lengths) if n > 0]
    if done:
        batch.write_states(conv_state, done, new_state[done])
    snap = None
    if snapshots is not None:
        reqs = torch.tensor([r for r, _ in snapshots], dtype=torch.long, device=x.device)
        offs = torch.tensor([n for _, n in snapshots], dtype=torch.long, device=x.device)
        snap = ext[state_start[reqs][:, None] + offs[:, None] + window]
    if x.dtype != torch.float32:
        # A low-precision conv rounds its output before the activation (transformers and the
        # causal-conv1d kernels do): round here too, so bf16 states match the reference's.
        out = out.to(x.dtype).float()
    return F.silu(out), snap


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


def first_attr(config: object, *names: str, default: object = None) -> object:
    """The first attribute of ``config`` among ``names`` that is set (families name the same thing apart)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"config has none of {names}")
    return default


def _default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor; tolerate squeezed singleton dims (``conv1d.weight`` as ``[C, K]``)."""
    if loaded.numel() != param.numel() or loaded.squeeze().shape != param.squeeze().shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.reshape(param.shape))


def make_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized inference parameter that knows how to load itself from a checkpoint tensor."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = _default_weight_loader
    return param


class WeightHolder(nn.Module):
    """A named ``weight`` (+ optional ``bias``): keeps parameter names equal to the checkpoint's."""

    def __init__(self, weight_shape: tuple[int, ...], bias_size: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = make_param(*weight_shape, dtype=dtype)
        self.bias = None if bias_size is None else make_param(bias_size, dtype=dtype)


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load ``(name, tensor)`` pairs named relative to ``module``; returns the names loaded."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        if name not in params:
            raise KeyError(f"unexpected weight {name!r}; this layer has {sorted(params)}")
        param = params[name]
        getattr(param, "weight_loader", _default_weight_loader)(param, tensor)
        loaded.add(name)
    return loaded


class RecurrentLayer(nn.Module):
    """A layer whose requests each own a (conv state, recurrent state) pair, advanced in place.

    Subclasses (Mamba2 mixer, gated DeltaNet) set ``dims_type`` (a dims dataclass with ``from_config``),
    and implement ``_state_shapes(dims)`` and ``_run(hidden_states, batch, conv_state, recurrent_state,
    checkpoint_every)``, which returns the output and, when ``checkpoint_every`` is set, the checkpoints.
    """

    dims_type: type

    @classmethod
    def dims_of(cls, config: object) -> object:
        """``config`` itself if it is already the layer's dims, else its dims read from an HF config."""
        return config if isinstance(config, cls.dims_type) else cls.dims_type.from_config(config)

    @classmethod
    def state_shapes(
        cls, config: object, dtype: str = "float32", recurrent_dtype: str | None = None
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """Per-request ``(conv state shape, recurrent state shape)`` and their dtypes."""
        return cls._state_shapes(cls.dims_of(config)), (dtype, recurrent_dtype or dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors named relative to this layer (``in_proj.weight`` ...)."""
        return load_named_weights(self, weights)

    def forward(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden_states [num_tokens, hidden]`` -> ``[num_tokens, hidden]``; states advanced in place."""
        out, _ = self._run(hidden_states, batch, conv_state, recurrent_state, checkpoint_every=None)
        return out

    def forward_with_checkpoints(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        checkpoint_every: int,
    ) -> tuple[torch.Tensor, StateCheckpoints]:
        """Like ``forward``, and also return the states after every absolute multiple of
        ``checkpoint_every`` tokens reached in this step (``batch.num_computed_tokens`` required)."""
        out, ckpt = self._run(hidden_states, batch, conv_state, recurrent_state, checkpoint_every)
        assert ckpt is not None
        return out, ckpt
