"""csrc/lora.c against the torch reference (`tokenos.lora.layers.apply_torch`): random shapes, ranks,
one to three pieces over a fused output, segments that start mid-batch, both dtypes."""

from __future__ import annotations

import pytest
import torch

from tokenos.layers import cpu_kernels
from tokenos.layers.linear import Linear
from tokenos.lora.adapter import ModuleWeights, Piece
from tokenos.lora.layers import LoRALayer, LoRAStep, apply_torch

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels unavailable")


def _weights(k: int, sizes: list[int], ranks: list[int], dtype: torch.dtype, gen) -> ModuleWeights:
    pieces, r0, offset = [], 0, 0
    for size, r in zip(sizes, ranks, strict=True):
        if r:
            pieces.append(Piece(offset, size, r0, r, torch.randn(r, size, generator=gen).to(dtype)))
            r0 += r
        offset += size
    return ModuleWeights(torch.randn(r0, k, generator=gen).to(dtype), pieces)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "k, sizes, ranks",
    [
        (64, [96], [8]),
        (576, [576, 192, 192], [16, 0, 16]),
        (200, [300, 300], [4, 12]),
        (33, [17, 5, 9], [3, 1, 2]),
    ],
)
def test_kernel_matches_the_reference(dtype, k, sizes, ranks):
    gen = torch.Generator().manual_seed(k)
    w = _weights(k, sizes, ranks, dtype, gen)
    step = LoRAStep()
    layer = LoRALayer(step, Linear(k, sum(sizes)))
    layer.add("a", w)
    assert w.desc is not None
    x = torch.randn(23, k, generator=gen).to(dtype)
    y = torch.randn(23, sum(sizes), generator=gen).to(dtype)
    one = _weights(k, sizes, ranks[::-1], dtype, gen)  # a second adapter on a one-token segment
    layer.add("b", one)
    want = y.clone()
    apply_torch(x[5:19], want[5:19], w)
    apply_torch(x[19:20], want[19:20], one)
    step.set([("a", 5, 19), ("b", 19, 20), ("missing", 20, 23)])
    got = layer(x, y.clone())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(got[:5], y[:5]) and torch.equal(got[20:], y[20:])  # outside the segments: untouched


def test_long_segments_take_torch_and_short_ones_the_kernel_in_one_step(monkeypatch):
    import tokenos.lora.layers as layers

    gen = torch.Generator().manual_seed(1)
    w = _weights(64, [32, 16], [4, 4], torch.float32, gen)
    monkeypatch.setattr(layers, "KERNEL_MAX_MACS", 2 * w.macs_per_token)  # 1-2 tokens: the kernel
    calls = []
    monkeypatch.setattr(layers, "apply_matmul", lambda x, y, w: calls.append(len(x)) or apply_torch(x, y, w))
    step = LoRAStep()
    layer = LoRALayer(step, Linear(64, 48))
    layer.add("a", w)
    x, y = torch.randn(12, 64, generator=gen), torch.randn(12, 48, generator=gen)
    want = y.clone()
    apply_torch(x[0:9], want[0:9], w)
    apply_torch(x[10:12], want[10:12], w)
    step.set([("a", 0, 9), ("b", 9, 10), ("a", 10, 12)])
    torch.testing.assert_close(layer(x, y.clone()), want)
    assert calls == [9]  # the 2-token segment went to the kernel
