"""Batch invariance (``TOKENOS_BATCH_INVARIANT=1``, `cpu_kernels.set_batch_invariant`): a quantized
linear's row and a decode's attention come out the same bits whatever else shares the call. By default
they do not (the kernel is picked by row count, decode attention by batch size), which the first test
pins down so that the others cannot pass by accident."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.kernels import batch_invariant, random_quantized
from tokenos.layers import cpu_kernels
from tokenos.layers.attention import allocate_kv_cache
from tokenos.layers.quantization import QuantizedWeight

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels (no compiler)")

KERNEL_DTYPES = [d for d in (torch.float32, torch.bfloat16) if cpu_kernels.qgemm_kernel(d) is not None]
ROW_COUNTS = (1, 2, 5, 9, 16, 17, 40, 100)


def _weight(n: int, k: int, bits: int, group: int, zeros: bool, seed: int) -> QuantizedWeight:
    return QuantizedWeight(random_quantized(n, k, bits, group, zeros, seed))


def _rows_alone_and_together(qw: QuantizedWeight, x: torch.Tensor, out_dtype: torch.dtype):
    """For each row count m: the first m rows in one call, and each of them in a call of its own."""
    alone = torch.cat([qw(x[i : i + 1], out_dtype=out_dtype) for i in range(x.shape[0])])
    return {m: qw(x[:m], out_dtype=out_dtype) for m in ROW_COUNTS}, alone


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no quantized-linear kernel on this CPU")
def test_without_invariance_a_row_depends_on_the_row_count():
    """The reason for the mode: at default settings some row count gives a row other bits than a call
    of that row alone (another kernel, another summation order)."""
    dtype = KERNEL_DTYPES[-1]
    qw = _weight(576, 1536, 4, 32, True, seed=1)
    x = torch.randn(100, 1536).to(dtype)
    with batch_invariant(False):
        together, alone = _rows_alone_and_together(qw, x, torch.float32)
    assert any(not torch.equal(together[m], alone[:m]) for m in ROW_COUNTS if m > 1)


@pytest.mark.skipif(not KERNEL_DTYPES, reason="no quantized-linear kernel on this CPU")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    ("bits", "zeros", "n", "k", "group"),
    [(4, True, 576, 1536, 32), (4, False, 100, 192, 64), (8, False, 48, 256, 128), (8, True, 40, 64, 32)],
)
def test_a_linear_row_is_the_same_bits_at_every_row_count(dtype, bits, zeros, n, k, group):
    """1 to 100 rows (the GEMV, few-row and panel sizes of the default dispatch), fp32 and bf16 outputs,
    odd block counts: every row equal to itself computed alone, and close to the dequantized reference."""
    qw = _weight(n, k, bits, group, zeros, seed=n + k + bits)
    x = torch.randn(100, k).to(dtype)
    weight = qw.dequantize().double()
    want = x.double() @ weight.T
    # fp32 rows: fp32 sums; bf16 rows on the panel path (no AMX) multiply weights rounded to bf16.
    bound = (1e-5 if dtype == torch.float32 else 2**-8) * (x.double().abs() @ weight.abs().T).max().item()
    with batch_invariant():
        for out_dtype in (torch.float32, dtype):
            together, alone = _rows_alone_and_together(qw, x, out_dtype)
            for m, rows in together.items():
                assert torch.equal(rows, alone[:m]), (out_dtype, m)
            if out_dtype == torch.float32:
                err = (alone.double() - want).abs().max().item()
                assert err <= bound, err


@pytest.mark.skipif(cpu_kernels.qargmax_kernel() is None, reason="bf16 quantized kernels not built")
def test_greedy_ids_are_the_same_at_every_row_count():
    """The LM head's fused argmax (no logits stored) picks each row's id as that row alone would."""
    qw = _weight(1000, 576, 8, 32, False, seed=7)
    x = torch.randn(100, 576).bfloat16()
    with batch_invariant():
        alone = torch.cat([qw.argmax(x[i : i + 1]) for i in range(100)])
        for m in ROW_COUNTS:
            assert torch.equal(qw.argmax(x[:m]), alone[:m]), m
        assert torch.equal(alone, qw(x, out_dtype=torch.float32).argmax(1))


def _decode(q, cache, tables, lens, block):
    table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    epochs = torch.arange(cache.shape[0], dtype=torch.int64)
    return cpu_kernels.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), 0.125, None,
                                    page_epochs=epochs)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_attends_the_same_bits_alone_or_in_a_batch(dtype):
    """Requests sharing a cached prefix (what cascade attention groups) and long ones (what split-KV
    splits by batch size): each request's output in a batch of 24 equals its output alone, as a
    speculative verify's tokens must equal the decodes they replace."""
    torch.manual_seed(3)
    block, prefix_pages = 16, 20
    tables, lens, page = [], [], 1 + prefix_pages
    for r in range(24):
        own = 1 + r % 5 if r < 12 else 20 + r  # 12 sharing a 320-token prefix, 12 of 500 to 700 tokens
        table = list(range(1, 1 + prefix_pages)) if r < 12 else []
        table += list(range(page, page + own))
        page += own
        tables.append(table)
        lens.append(len(table) * block - r % block)
    cache = allocate_kv_cache(page, block, 3, 64, dtype).normal_()
    q = torch.randn(len(tables), 9, 64)
    with batch_invariant(False):  # by default a long request splits by batch size, and a group is cascaded
        together = _decode(q, cache, tables, lens, block)
        alone = [_decode(q[r : r + 1], cache, tables[r : r + 1], lens[r : r + 1], block) for r in range(24)]
        assert not all(torch.equal(together[r : r + 1], alone[r]) for r in range(24))
    with batch_invariant():
        together = _decode(q, cache, tables, lens, block)
        for r in range(len(tables)):
            alone = _decode(q[r : r + 1], cache, tables[r : r + 1], lens[r : r + 1], block)
            assert torch.equal(together[r : r + 1], alone), r
