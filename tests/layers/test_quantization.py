"""Weight-only quantized linears (tokenos/layers/quantization.py, csrc/qlinear.c): the kernel against
the dequantized torch reference over random shapes, group sizes, bits and row counts (both the few-row
and the panel path), the packed layout against the logical tensor, GGUF's Q8_0 / Q4_0 / Q4_1 blocks
against gguf's own dequantization, and the layers that load quantized shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.kernels import random_quantized
from tokenos.layers import cpu_kernels
from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.linear import Linear, QKVLinear
from tokenos.layers.quantization import QuantizedWeight, quantize
from tokenos.model_loader.gguf_loader import gguf_quantized
from tokenos.platform import native_bf16_supported

KERNEL_DTYPES = [
    d
    for d in (torch.float32, torch.bfloat16)
    if cpu_kernels.qgemm_kernel(d) is not None and (d == torch.float32 or native_bf16_supported())
]


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 5),
    tail=st.integers(0, 15),
    groups=st.integers(1, 4),
    group=st.sampled_from([2, 8, 16, 32, 64, 3, 5]),
    bits=st.sampled_from([4, 8]),
    zeros=st.booleans(),
)
def test_packing_round_trips(blocks, tail, groups, group, bits, zeros):
    n, k = 16 * blocks - tail, groups * group
    t = random_quantized(n, k, bits, group, zeros, seed=n * k)
    back = QuantizedWeight(t).unpack()
    assert torch.equal(back.q, t.q)
    assert torch.equal(back.scales, t.scales)
    assert (back.zeros is None) == (t.zeros is None)
    if zeros:
        assert torch.equal(back.zeros, t.zeros)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize(
    ("n", "k", "group"), [(40, 64, 32), (17, 128, 128), (100, 96, 16), (48, 40, 8), (33, 30, 6)]
)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_matches_dequantized_reference(bits, zeros, n, k, group, dtype):
    t = random_quantized(n, k, bits, group, zeros, seed=n + k + bits)
    qw = QuantizedWeight(t)
    weight = t.dequantize()
    # Few rows (1..16 for bf16, in passes of up to 8 from 9; 1..3 for float32) take the few-row path,
    # more the panel path (tiles and their remainders).
    for m in (1, 2, 3, 5, 8, 9, 13, 16, 17, 70):
        x = torch.randn(m, k).to(dtype)
        want = F.linear(x.float(), weight)
        got = qw(x)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        scale = want.abs().max().item()
        # bf16: the only extra rounding is of each dequantized weight (panel path) and of the output.
        assert (got.float() - want).abs().max().item() <= tol * scale, (m, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_float32_panel_rows_are_the_same_in_every_piece(bits, monkeypatch):
    """Past 512 rows the float32 panel runs in pieces of rows (TOKENOS_QUANT_DENSE_FROM set high keeps
    the panel there): every row equals the same row run alone through the panel, bit for bit."""
    if cpu_kernels.qgemm_kernel(torch.float32) is None:
        pytest.skip("no float32 quantized kernel")
    monkeypatch.setenv("TOKENOS_QUANT_DENSE_FROM", "100000")
    t = random_quantized(48, 64, bits, 32, True, seed=bits)
    qw = QuantizedWeight(t)
    x = torch.randn(1030, 64)
    got = qw(x)
    assert (got - F.linear(x, t.dequantize())).abs().max().item() <= 1e-5 * got.abs().max().item()
    # Rows 512.. and 1024.. begin the second and third pieces; 6-row tiles there as anywhere.
    for r0 in (0, 506, 512, 1024):
        assert torch.equal(qw(x[r0 : r0 + 6]), got[r0 : r0 + 6]), r0


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_float32_output_bias_and_strided_rows(dtype):
    t = random_quantized(50, 64, 4, 32, True, seed=3)
    qw = QuantizedWeight(t)
    base = torch.randn(7, 128).to(dtype)
    x = base[:, :64]  # rows with a stride: the kernel reads them in place
    bias = torch.randn(50).to(dtype)
    want = F.linear(x.float(), t.dequantize(), bias.float())
    got = qw(x, bias)
    assert torch.allclose(got.float(), want, atol=2e-2 * want.abs().max().item())
    logits = qw(x, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, F.linear(x.float(), t.dequantize()), rtol=1e-2, atol=1e-2)


def test_torch_path_without_kernel_is_the_reference(monkeypatch):
    t = random_quantized(20, 64, 8, 16, False, seed=5)
    qw = QuantizedWeight(t)
    monkeypatch.setattr(qw, "_gemms", {})
    x = torch.randn(3, 64)
    assert torch.allclose(qw(x), F.linear(x, t.dequantize()), atol=1e-5)
    assert torch.equal(qw.dequantize(), t.dequantize())


@pytest.mark.skipif(cpu_kernels.qdequant_kernel() is None, reason="fp32 quantized kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 64, 32), (17, 128, 128), (100, 96, 16), (33, 30, 6)])
def test_dequant_kernel_gives_dequantize_floats_exactly(bits, zeros, n, k, group):
    qw = QuantizedWeight(random_quantized(n, k, bits, group, zeros, seed=n * k + bits))
    if torch.float32 not in qw._gemms:
        pytest.skip("a K or group the kernels do not take (the torch path runs)")
    want = qw.dequantize(torch.float32)
    for n0, n1 in ((0, n), (16, n), (0, 16), (16, min(n, 33)), (n - 1 - (n - 1) % 16, n)):
        out = torch.full((n1 - n0, k), float("nan"))
        cpu_kernels.qdequant_kernel()(qw._desc_address, n0, n1, out.data_ptr())
        assert torch.equal(out, want[n0:n1]), (n0, n1)


@pytest.mark.skipif(
    cpu_kernels.qgemm_kernel(torch.float32) is None, reason="fp32 quantized kernels not built"
)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("pieces", [False, True])
def test_many_rows_take_dequantize_and_gemm_like_the_panel(monkeypatch, bits, pieces):
    from tokenos.layers import quantization

    t = random_quantized(100, 96, bits, 32, True, seed=bits)
    qw, bias = QuantizedWeight(t), torch.randn(100)
    if pieces:  # the weight in several pieces of rows, as an LM head is
        monkeypatch.setattr(quantization, "SCRATCH_FLOATS", 32 * 96)
    x = torch.randn(70, 96)
    want = F.linear(x, t.dequantize(), bias)
    real, calls = cpu_kernels.qdequant_kernel(), []
    monkeypatch.setattr(cpu_kernels, "qdequant_kernel", lambda: lambda *a: calls.append(a) or real(*a))
    for rows, dequantized in (("1000000", 0), ("71", 0), ("70", 4 if pieces else 1)):
        monkeypatch.setenv("TOKENOS_QUANT_DENSE_FROM", rows)
        calls.clear()
        got = qw(x, bias)
        assert len(calls) == dequantized, rows
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), rows


def test_dense_from_rows_follows_the_cpu_and_the_override(monkeypatch):
    from tokenos.layers import quantization

    monkeypatch.setenv("TOKENOS_QUANT_DENSE_FROM", "7")
    assert quantization.dense_from_rows() == 7
    monkeypatch.delenv("TOKENOS_QUANT_DENSE_FROM")
    avx512 = "avx512f" in quantization.cpu_info()[1]
    want = quantization.DENSE_FROM_ROWS_AVX512 if avx512 else quantization.DENSE_FROM_ROWS_AVX2
    assert quantization.dense_from_rows() == want


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_dequantized_table_rows(bits):
    t = random_quantized(70, 48, bits, 16, bits == 4, seed=9)
    qw = QuantizedWeight(t)
    ids = torch.tensor([[0, 69, 15], [16, 33, 8]])
    assert torch.equal(qw.rows(ids, torch.float32), t.dequantize()[ids])


@pytest.mark.parametrize("bits", [4, 8])
def test_online_quantization_error_is_half_a_step(bits):
    w = torch.randn(64, 256) * 0.1
    t = quantize(w, bits)
    assert t.group == (128 if bits == 8 else 32)
    step = t.scales.float().repeat_interleave(t.group, dim=1)
    err = (t.dequantize() - w).abs()
    # Half a quantization step, plus the fp16 rounding of scale and zero.
    assert bool((err <= step * 0.5 + 1e-3 * w.abs().max()).all())
    assert quantize(torch.zeros(16, 32), bits).dequantize().abs().max() == 0


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_map_exactly(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    kind = GGMLQuantizationType[qtype]
    data = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    raw = gguf_quantize(data, kind)
    t = gguf_quantized(raw, int(kind))
    assert t is not None and t.group == 32 and t.bits == (8 if qtype == "Q8_0" else 4)
    assert np.array_equal(t.dequantize().numpy(), dequantize(raw, kind))
    # And through the packed layout and the kernel's own dequantization.
    assert np.array_equal(QuantizedWeight(t).dequantize().numpy(), dequantize(raw, kind))
    assert gguf_quantized(raw, int(GGMLQuantizationType.Q2_K)) is None  # not held: dequantized


def test_fused_linear_takes_quantized_shards():
    torch.manual_seed(0)
    layer = QKVLinear(64, 16, 4, 2, bias=False)
    shards = {name: quantize(torch.randn(rows, 64), 4) for name, rows in (("q", 64), ("k", 32), ("v", 32))}
    for name, t in shards.items():
        layer.weight.weight_loader(layer.weight, t, name)
    layer.pack()
    assert layer.weight is None and layer.quantized is not None
    x = torch.randn(5, 64)
    want = F.linear(x, torch.cat([shards[s].dequantize() for s in ("q", "k", "v")]))
    assert torch.allclose(layer(x), want, atol=1e-4)


def test_fused_shards_quantized_differently_meet_exactly():
    """A Q4_K_M-style layer: int4 per 32 for q / k, int8 per 16 for v, stacked exactly as int8 per 16."""
    torch.manual_seed(0)
    layer = QKVLinear(64, 16, 4, 2, bias=False)
    shards = {"q": quantize(torch.randn(64, 64), 4, 32), "k": quantize(torch.randn(32, 64), 4, 32)}
    shards["v"] = quantize(torch.randn(32, 64), 8, 16)
    for name, t in shards.items():
        layer.weight.weight_loader(layer.weight, t, name)
    layer.pack()
    assert (layer.quantized.bits, layer.quantized.group) == (8, 16)
    want = torch.cat([shards[s].dequantize() for s in ("q", "k", "v")])
    assert torch.equal(layer.quantized.dequantize(), want)


def test_fused_linear_with_a_dense_shard_runs_dense():
    torch.manual_seed(0)
    layer = QKVLinear(64, 16, 4, 2, bias=False)
    q, k = quantize(torch.randn(64, 64), 8), quantize(torch.randn(32, 64), 8)
    v = torch.randn(32, 64)
    layer.weight.weight_loader(layer.weight, q, "q")
    layer.weight.weight_loader(layer.weight, k, "k")
    layer.weight.weight_loader(layer.weight, v, "v")
    layer.pack()
    assert layer.quantized is None
    x = torch.randn(3, 64)
    want = F.linear(x, torch.cat([q.dequantize(), k.dequantize(), v]))
    assert torch.allclose(layer(x), want, atol=1e-4)


def test_linear_refuses_a_quantized_shard_of_the_wrong_shape():
    layer = Linear(64, 32)
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight.weight_loader(layer.weight, quantize(torch.randn(16, 64), 8))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_online_quantized_linear(method):
    torch.manual_seed(0)
    layer = Linear(128, 48, bias=True)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack(method)
    assert layer.weight is None and layer.quantized.bits == (8 if method == "int8" else 4)
    x = torch.randn(4, 128)
    want = F.linear(x, quantize(w, layer.quantized.bits).dequantize(), b)
    assert torch.allclose(layer(x), want, atol=1e-4)


def test_tied_head_and_embedding_share_one_quantized_table():
    embed = VocabEmbedding(40, 32)
    head = LMHead(40, 32, tied_to=embed)
    t = quantize(torch.randn(40, 32), 8, 32)
    embed.weight.weight_loader(embed.weight, t)
    head.pack()
    embed.pack()
    assert head.quantized is embed.quantized and embed.weight is None
    ids = torch.tensor([3, 39])
    assert torch.equal(embed(ids), t.dequantize()[ids].to(embed.dtype))
    hidden = torch.randn(2, 32)
    assert torch.allclose(head(hidden), F.linear(hidden, t.dequantize()), atol=1e-4)


@pytest.mark.parametrize(("qtype", "bits", "group"), [("Q4_K", 4, 32), ("Q5_K", 8, 32), ("Q6_K", 8, 16)])
def test_gguf_k_quants_map_up_to_fp16_scales(qtype, bits, group):
    """K-quant super-blocks (random bytes with sane fp16 scales: gguf cannot quantize to them) against
    gguf's own dequantization: equal up to the one fp16 rounding of each sub-block's scale and zero."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from tokenos.model_loader.gguf_loader import _KEPT_TYPES

    kind = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    rows, supers = 40, 2
    blocks = rng.integers(0, 256, (rows, supers, _KEPT_TYPES[int(kind)]), dtype=np.uint8)
    for field in [slice(-2, None)] if qtype == "Q6_K" else [slice(0, 2), slice(2, 4)]:
        scale = (rng.random((rows, supers)) * 0.02 + 1e-3).astype(np.float16)
        blocks[..., field] = scale.view(np.uint8).reshape(rows, supers, 2)
    raw = blocks.reshape(rows, -1)
    t = gguf_quantized(raw, int(kind))
    assert t is not None and (t.bits, t.group) == (bits, group)
    want = dequantize(raw, kind)
    got = QuantizedWeight(t).dequantize().numpy()
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_a_multiplier_folded_at_load_scales_a_quantized_weight():
    """Granite / Falcon-H1 fold muP multipliers into weights at load (`scale_on_load`): a quantized
    checkpoint tensor takes them through its scales and zeros."""
    from tokenos.layers.weights import scale_on_load

    layer = Linear(64, 32)
    scale_on_load(layer.weight, 0.5)
    t = quantize(torch.randn(32, 64), 4)
    layer.weight.weight_loader(layer.weight, t)
    layer.pack()
    assert torch.allclose(layer.quantized.dequantize(), 0.5 * t.dequantize(), atol=1e-3)


@pytest.mark.skipif(not cpu_kernels.uses_amx(), reason="no AMX-BF16 (or the OS refused its tiles)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (100, 96), (576, 1536)])
def test_amx_panel_path_matches_the_avx512_panel_path(bits, n, k):
    """Both multiply the same bf16-rounded dequantized panel in fp32, so they differ only by the order
    of the fp32 sums; row counts past the few-row paths (AMX takes up to 16 rows exactly, below), and
    rows read with a stride."""
    t = random_quantized(n, k, bits, 32, True, seed=n + k)
    qw = QuantizedWeight(t)
    base = torch.randn(70, k + 32).bfloat16()
    allowed = cpu_kernels.uses_amx()
    try:
        for m in (17, 32, 33, 70):
            x = base[:m, :k]
            cpu_kernels.set_amx(False)
            panel = qw(x, out_dtype=torch.float32)
            cpu_kernels.set_amx(True)
            amx = qw(x, out_dtype=torch.float32)
            scale = panel.abs().max().item()
            assert (amx - panel).abs().max().item() <= 1e-5 * k**0.5 * scale, m
            assert not torch.equal(amx[:, :1], torch.zeros_like(amx[:, :1]))
    finally:
        cpu_kernels.set_amx(allowed)


@pytest.mark.skipif(not cpu_kernels.uses_amx(), reason="no AMX-BF16 (or the OS refused its tiles)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 64, 32), (100, 192, 64), (576, 1536, 32), (48, 256, 128)])
def test_amx_few_row_path_is_exact_as_the_avx512_few_row_path(bits, zeros, n, k, group):
    """2 to 16 rows on AMX multiply the integer cells and apply each group's scale and zero to the tile
    sums, as the AVX-512 few-row path does: no weight is rounded, so both sit within fp32 summation
    error of a float64 reference (a bf16-rounded weight would be off by about 2^-9 of each product).
    Odd block counts, rows with a stride, fp32 and bf16 outputs."""
    t = random_quantized(n, k, bits, group, zeros, seed=n * k + bits)
    qw = QuantizedWeight(t)
    weight = t.dequantize().double()
    base = torch.randn(16, k + 32).bfloat16()
    allowed = cpu_kernels.uses_amx()
    try:
        for m in (2, 3, 4, 5, 8, 9, 13, 16):
            x = base[:m, :k]
            want = x.double() @ weight.T
            bound = 1e-6 * k**0.5 * (x.double().abs() @ weight.abs().T).max().item()
            cpu_kernels.set_amx(True)
            amx = qw(x, out_dtype=torch.float32)
            assert (amx.double() - want).abs().max().item() <= bound, m
            assert torch.allclose(qw(x).float(), amx, rtol=2**-8, atol=0), m
            if m <= 8:
                cpu_kernels.set_amx(False)
                avx512 = qw(x, out_dtype=torch.float32)
                assert (avx512.double() - want).abs().max().item() <= bound, m
    finally:
        cpu_kernels.set_amx(allowed)


@pytest.mark.skipif(cpu_kernels.qrows_kernel() is None, reason="fp32 quantized kernels not built")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 64, 32), (17, 128, 128), (100, 96, 16), (300, 576, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_kernel_gives_the_torch_rows_exactly(bits, zeros, n, k, group, dtype):
    """An embedding lookup from packed rows (csrc/qlinear.c's qrows_desc): the same bits as the torch
    ops, for every lane of a 16-row block, both nibbles of an int4 cell, and a table of n % 16 != 0."""
    qw = QuantizedWeight(random_quantized(n, k, bits, group, zeros, seed=n + k + bits))
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (37,), generator=torch.Generator().manual_seed(n))])
    got, want = qw.rows(ids.view(-1, 1), dtype), qw._rows_reference(ids.view(-1, 1), dtype)
    bits_view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.shape == want.shape == (len(ids), 1, k)
    assert torch.equal(got.view(bits_view), want.view(bits_view))
    with pytest.raises(IndexError):
        qw.rows(torch.tensor([n]), dtype)
