"""The recurrent half of speculative verification on a real Mamba2 mixer and gated DeltaNet layer: the
verify pass keeps the state after every verified position, equal to what plain one-token decoding of the
same tokens leaves, and `commit_verified` makes the accepted one the running state in the column the
scheduler's contract reads next step (an earlier page when the drafts crossed a boundary and some were
rejected), with no second forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenos.layers.gated_delta import GatedDeltaDims, GatedDeltaNet
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from tokenos.layers.metadata import ForwardBatch
from tokenos.worker.recurrent import build_recurrent_batch, commit_verified

HIDDEN = 16
B = 4  # recurrent block size (checkpoint interval) of the page table below
NUM_PAGES = 12


def make_layer(kind: str) -> Mamba2Mixer | GatedDeltaNet:
    if kind == "mamba2":
        layer = Mamba2Mixer(Mamba2Dims(HIDDEN, 4, 8, 8, 2, 4, 8))
    else:
        layer = GatedDeltaNet(GatedDeltaDims(HIDDEN, 2, 4, 8, 8, 4))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    layer.cache_index = 0
    return layer


def pools(layer, gen: torch.Generator) -> list[torch.Tensor]:
    shapes, _ = layer.state_shapes(layer.dims)
    return [torch.randn((NUM_PAGES, *s), generator=gen) for s in shapes]


def run(layer, hidden: torch.Tensor, caches: list[torch.Tensor], rbatch) -> torch.Tensor:
    batch = ForwardBatch(
        torch.zeros(len(hidden), dtype=torch.long), torch.zeros(len(hidden)), [caches], [rbatch]
    )
    return layer(hidden, batch)


def decode_one_by_one(layer, hidden: torch.Tensor, caches: list[torch.Tensor], page: int, n: int):
    """Plain decoding of ``hidden``'s tokens from the state in ``page``: outputs and the state after each."""
    outs, states = [], []
    for t in range(len(hidden)):
        rb = build_recurrent_batch(np.array([0, 1]), np.array([n + t]), np.array([1]), np.array([page]))
        outs.append(run(layer, hidden[t : t + 1], caches, rb))
        states.append([c[page].clone() for c in caches])
    return torch.cat(outs), states


@pytest.mark.parametrize("kind", ["mamba2", "gated_delta"])
@pytest.mark.parametrize("kept", [1, 2, 3, 4])
def test_the_accepted_state_is_selected_into_the_running_column(kind, kept):
    """Request 0 verifies 1 + 3 drafts from n = 6 (tokens 6..9 cross the boundary at 8: columns 1 and 2);
    beside it a plain decode and a prefill. After committing ``kept`` tokens its page of column
    (6 + kept - 1) // 4 holds exactly the state plain decoding of those tokens leaves."""
    layer = make_layer(kind)
    gen = torch.Generator().manual_seed(1)
    caches = pools(layer, gen)
    # Block tables (one row per request): request 0 holds column 1 (page 1, its state after 6 tokens)
    # and column 2 (page 2, the verify step's running column).
    table = np.array([[0, 1, 2, 0], [0, 0, 3, 0], [4, 0, 0, 0]])
    num_computed, num_sched = np.array([6, 9, 0]), np.array([4, 1, 3])
    running = np.array([2, 3, 4])
    caches[0][2] = caches[0][1]  # the scheduler's state copy, column 1 -> 2, before the step
    caches[1][2] = caches[1][1]
    reference = [c.clone() for c in caches]
    hidden = torch.randn(int(num_sched.sum()), HIDDEN, generator=gen)
    qsl = np.concatenate(([0], np.cumsum(num_sched)))
    rb = build_recurrent_batch(qsl, num_computed, num_sched, running, verify_reqs=[0])
    out = run(layer, hidden, caches, rb)
    plain_out, plain_states = decode_one_by_one(layer, hidden[:4], reference, 1, 6)
    torch.testing.assert_close(out[:4], plain_out, rtol=0, atol=1e-5)
    assert commit_verified(rb, [kept, 1, 3], table, B) == (0 if kept == 4 else 1)
    page = table[0, (6 + kept - 1) // B]
    for pool, want in zip(caches, plain_states[kept - 1], strict=True):
        torch.testing.assert_close(pool[page], want, rtol=0, atol=1e-5)
    # The other requests' pages are the pass's own: untouched by the commit.
    plain = build_recurrent_batch(qsl[1:] - qsl[1], num_computed[1:], num_sched[1:], running[1:])
    run(layer, hidden[4:], reference, plain)
    for pool, ref in zip(caches, reference, strict=True):
        torch.testing.assert_close(pool[3:5], ref[3:5], rtol=0, atol=1e-5)


def test_a_verify_batch_checks_its_requests():
    qsl, n, k, pages = np.array([0, 1, 4]), np.array([3, 5]), np.array([1, 3]), np.array([1, 2])
    with pytest.raises(ValueError, match="at least 2 new tokens"):
        build_recurrent_batch(qsl, n, k, pages, verify_reqs=[0])
    rb = build_recurrent_batch(qsl, n, k, pages, verify_reqs=[1])
    assert rb.verify_positions == [(1, 1), (1, 2), (1, 3)] and rb.prefill_reqs == [] and rb.decode_reqs == [0]
    with pytest.raises(ValueError, match="kept 4"):
        commit_verified(rb, [1, 4], np.array([[1, 0], [0, 2]]), B)
