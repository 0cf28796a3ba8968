"""Shared pieces of the recurrent-layer tests (Mamba2, gated DeltaNet): run a layer over a varlen
batch with states in place, NaN-filled fresh states (a layer must never read a state it was told is
absent), and the split-prefill invariant every recurrent layer must keep."""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.recurrent_batch import RecurrentBatch


def run(
    layer: nn.Module,
    seqs: list[torch.Tensor],
    conv: torch.Tensor,
    state: torch.Tensor,
    has_init: list[bool],
    state_indices: list[int] | None = None,
) -> list[torch.Tensor]:
    """One call over several requests; returns each request's output rows."""
    lengths = [len(s) for s in seqs]
    qsl = torch.tensor([0] + lengths).cumsum(0)
    indices = None if state_indices is None else torch.tensor(state_indices)
    batch = RecurrentBatch(qsl, torch.tensor(has_init), indices)
    return list(layer.advance(torch.cat(seqs), batch, conv, state).split(lengths))


def nan_states(shapes: tuple[tuple[int, ...], tuple[int, ...]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv_shape, state_shape = shapes
    return torch.full((n, *conv_shape), float("nan")), torch.full((n, *state_shape), float("nan"))


@torch.no_grad()
def check_split_prefill_equals_one_pass(
    layer: nn.Module, shapes: tuple, hidden: int, pieces: list[int], seed: int, atol: float
) -> None:
    """A prompt fed in pieces (each resuming from the state the previous one left) gives the same
    outputs and final states as one pass."""
    torch.manual_seed(seed)
    x = torch.randn(sum(pieces), hidden)
    conv1, state1 = nan_states(shapes, 1)
    whole = run(layer, [x], conv1, state1, [False])[0]
    conv2, state2 = nan_states(shapes, 1)
    parts, start = [], 0
    for i, n in enumerate(pieces):
        parts.append(run(layer, [x[start : start + n]], conv2, state2, [i > 0])[0])
        start += n
    torch.testing.assert_close(torch.cat(parts), whole, atol=atol, rtol=0)
    torch.testing.assert_close(conv2, conv1, atol=atol, rtol=0)
    torch.testing.assert_close(state2, state1, atol=atol, rtol=0)
