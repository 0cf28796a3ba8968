"""The greedy argmax kernel (csrc/argmax.c) against torch's ``max(dim=1).indices``, index for index: ties
(the first maximum wins), NaN (a row's first NaN wins), rows of -inf, strided rows, one long row cut into
pieces across threads, and both vector builds (AVX-512 and the AVX2 one of CPUs without it)."""

from __future__ import annotations

import pytest
import torch

from tokenos.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels unavailable")


def logits_cases(gen: torch.Generator):
    """(name, [rows, n] float32) pairs covering what could make an argmax pick another index."""
    yield "random", torch.randn(64, 49152, generator=gen)
    coarse = (torch.randn(37, 1001, generator=gen) * 2).round()  # many ties, as bf16 logits have
    coarse[:, :3] = coarse.max()
    yield "ties", coarse
    with_nan = torch.randn(9, 777, generator=gen)
    with_nan[2, 500] = with_nan[2, 600] = float("nan")  # the first NaN wins, past a larger value
    with_nan[2, 10] = 1e9
    with_nan[4, 0] = float("nan")
    with_nan[5, 776] = float("nan")  # in the scalar tail
    with_nan[6] = float("nan")
    yield "nan", with_nan
    flat = torch.full((5, 300), float("-inf"))
    flat[1, 299] = -1e30
    yield "-inf", flat
    yield "strided", torch.randn(12, 4096, generator=gen)[:, 7:3000]
    zeros = torch.zeros(3, 50)
    zeros[1, 20] = -0.0
    yield "signed zeros", zeros
    for n in (1, 15, 17, 33):
        yield f"short {n}", torch.randn(3, n, generator=gen)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_argmax_of_few_long_rows_cut_into_pieces(kernel_build, rows):
    # Fewer rows than threads: each row is cut into pieces that run on different threads.
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 49152, generator=gen) * 3).round()  # ties inside every piece
    top = x.max() + 1
    x[:, 40000] = top  # the maximum in the last piece, tied in the first piece for the last row
    x[-1, 100] = top
    assert torch.equal(cpu_kernels.argmax_rows(x), x.max(dim=1).indices)
    x[0, 45000] = float("nan")
    x[0, 20000] = float("nan")  # the first NaN, in the first piece
    assert torch.equal(cpu_kernels.argmax_rows(x), x.max(dim=1).indices)


def test_argmax_matches_torch_index_for_index(kernel_build):
    gen = torch.Generator().manual_seed(0)
    for name, x in logits_cases(gen):
        assert torch.equal(cpu_kernels.argmax_rows(x), x.max(dim=1).indices), name


def test_argmax_leaves_other_layouts_to_torch():
    assert cpu_kernels.argmax_rows(torch.randn(4, 10).bfloat16()) is None
    assert cpu_kernels.argmax_rows(torch.randn(10, 4).t()) is None  # columns not contiguous
    assert cpu_kernels.argmax_rows(torch.randn(10)) is None
