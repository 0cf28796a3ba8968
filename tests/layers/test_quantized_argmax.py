"""The LM head's greedy ids without its logits (csrc/qlinear.c's qgemm_bf16_argmax_desc): for every row
count (the AVX-512 few-row path, the AMX few-row path, the panel paths), bits and group, exactly the
argmax of the float32 products the same kernel stores, ties, NaN and all--inf rows included, with AMX on
and off."""

from __future__ import annotations

import pytest
import torch

from tokenos.layers import cpu_kernels
from tokenos.layers.quantization import QuantizedTensor, QuantizedWeight
from tokenos.platform import native_bf16_supported

pytestmark = pytest.mark.skipif(
    cpu_kernels.qargmax_kernel() is None or not native_bf16_supported(),
    reason="no bf16 quantized C kernel (an AVX512-BF16 CPU with the C kernels on)",
)

ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64)


def _weight(n: int, k: int, bits: int, group: int, seed: int, levels: int | None = None) -> QuantizedTensor:
    """Random cells; ``levels`` few distinct cells (and one scale) make many equal products: ties."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, levels or 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        lo = -(levels or 128)
        q = torch.randint(lo, -lo, (n, k), generator=g).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half()
    if levels:
        scales = torch.full_like(scales, 0.01)
    return QuantizedTensor(q, scales, None, bits, group)


def _check(qw: QuantizedWeight, x: torch.Tensor) -> None:
    for amx in {False, cpu_kernels.uses_amx()}:
        cpu_kernels.set_amx(amx)
        want = qw(x, out_dtype=torch.float32).argmax(dim=1)
        got = qw.argmax(x)
        assert got is not None
        assert torch.equal(got, want), (amx, x.shape[0])


@pytest.fixture(autouse=True)
def _restore_amx():
    allowed = cpu_kernels.uses_amx()
    yield
    cpu_kernels.set_amx(allowed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k", "group"), [(1000, 64, 32), (4099, 192, 64), (49152 // 8, 576, 32)])
def test_argmax_is_the_argmax_of_the_stored_products(bits, n, k, group):
    qw = QuantizedWeight(_weight(n, k, bits, group, seed=n + k + bits))
    base = torch.randn(64, k + 16).bfloat16()
    for m in ROWS:
        _check(qw, base[:m, :k])  # rows with a stride


@pytest.mark.parametrize("bits", [4, 8])
def test_ties_keep_the_first_column(bits):
    """Few levels and one scale: rows of many equal maxima, in and across tiles and threads."""
    qw = QuantizedWeight(_weight(2048, 64, bits, 32, seed=7, levels=2))
    x = torch.ones(40, 64).bfloat16()
    x[1::2] = torch.randint(0, 2, (20, 64)).bfloat16()
    for m in ROWS:
        _check(qw, x[:m])


def test_nan_and_minus_inf_rows():
    """A NaN product wins from its first column on (torch's argmax); a row of -inf products gives 0."""
    t = _weight(3000, 64, 8, 32, seed=3)
    scales = t.scales.clone()
    scales[2500, 1] = float("nan")  # column 2500: NaN in every row that reaches group 1
    qw = QuantizedWeight(QuantizedTensor(t.q, scales, None, 8, 32))
    x = torch.randn(20, 64).bfloat16()
    x[3] = float("-inf")  # -inf times cells of both signs: NaN and +-inf products
    for m in (1, 4, 9, 20):
        _check(qw, x[:m])
    plain = QuantizedWeight(QuantizedTensor(t.q.abs(), t.scales, None, 8, 32))
    neg = torch.full((5, 64), float("-inf")).bfloat16()
    neg[:, 1:] = 0
    _check(plain, neg)  # q >= 0: -inf or NaN (q = 0) per column; and rows of all -inf below
    assert torch.equal(plain.argmax(torch.zeros(3, 64).bfloat16()), torch.zeros(3, dtype=torch.int64))


def test_refuses_what_it_does_not_take():
    qw = QuantizedWeight(_weight(64, 64, 4, 32, seed=1))
    assert qw.argmax(torch.randn(2, 64)) is None  # float32 activations: the caller computes the logits
    assert qw.argmax(torch.randn(0, 64).bfloat16()) is None
