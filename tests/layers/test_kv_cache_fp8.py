"""FP8 (float8 e4m3fn) KV pages: the write clamps, the C decode kernel (native and AVX2 builds) reads
the bytes exactly as torch converts them, fp8 attention stays close to float32 attention, and the
pool holds twice the tokens of bf16 while recurrent states keep their dtype."""

from __future__ import annotations

import pytest
import torch

import tokenos.layers.attention as attention
from tests.layers.test_attention import decode_tables
from tokenos.config import KV_CACHE_DTYPE_CHOICES, CacheConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, get_kv_cache_config
from tokenos.layers import cpu_kernels
from tokenos.layers.attention import Attention, allocate_kv_cache, quantize_fp8
from tokenos.layers.attention_metadata import build_attention_metadata
from tokenos.platform import KV_CACHE_DTYPES, kv_cache_dtype_name

FP8 = torch.float8_e4m3fn


def test_quantize_clamps_to_the_e4m3_range():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 500.0, -1e4, float("inf"), -float("inf"), 1e-3])
    q = quantize_fp8(x, 1.0).float()
    assert torch.isfinite(q).all()
    assert q[4] == 448 and q[5] == -448 and q[6] == 448 and q[7] == -448
    assert q[1] == 1.0 and abs(q[2] + 3.3) <= 3.3 / 16  # 3 mantissa bits: relative error <= 2^-4
    # A scale divides before the clamp: 1000 / 4 = 250 fits.
    assert quantize_fp8(torch.tensor([1000.0]), 4.0).float().item() == 256.0  # 250 rounds to 256


def _every_bf16() -> torch.Tensor:
    """All 65,536 bf16 bit patterns (NaNs and infinities included), as [n, 2, 64] rows."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).view(-1, 2, 64)


@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_c_fp8_write_matches_torch_quantize_bit_for_bit(scale, kernel_build):
    """The C write stores exactly the bytes `quantize_fp8` makes: every bf16 value (the division by the
    scale rounded to bf16 as torch's is, subnormals, ties, values past 448 clamped; a NaN as a NaN byte),
    and float32 values between bf16's, into rows of the pages in any order; other rows stay untouched."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(int(scale * 100))
    dense = torch.randn(4096, 2, 64, generator=gen) * torch.logspace(-12, 3, 4096).view(-1, 1, 1)
    for x in (_every_bf16(), dense, dense.bfloat16()):
        n = x.shape[0] // 2
        k, v = x[:n], x[n : 2 * n]
        flat = torch.full((3 * n, 2, 64), 99, dtype=torch.uint8).view(FP8)
        rows = torch.randperm(3 * n, generator=gen)[: 2 * n]
        cpu_kernels.kv_write_8bit(k, v, flat, rows, scale, scale)
        as_bytes = flat.view(torch.uint8)
        for src, dst in ((k, rows[:n]), (v, rows[n:])):
            got, want = as_bytes[dst], quantize_fp8(src, scale).view(torch.uint8)
            nan = src.isnan()  # a NaN byte either way; torch's bf16 clamp may flip its sign bit
            assert ((got[nan] & 0x7F) == 0x7F).all() and ((want[nan] & 0x7F) == 0x7F).all()
            assert torch.equal(got[~nan], want[~nan]), x.dtype
        untouched = torch.ones(3 * n, dtype=torch.bool)
        untouched[rows] = False
        assert (as_bytes[untouched] == 99).all()


@pytest.mark.parametrize("head_size", [256, 8])
def test_c_kernel_widens_every_fp8_byte_exactly(head_size, kernel_build):
    """One cached token per request: softmax weight 1, so the output is that token's V row, widened by
    the kernel. Every finite e4m3fn byte (subnormals, +-0, +-448) must come out as torch converts it.
    head_size 256: the AVX-512 tile path where built; 8: the generic loop."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN bytes: writers never store them
    rows = codes.view(-1, head_size)  # [requests, head_size]
    n = rows.shape[0]
    cache = torch.zeros(n + 1, 2, 1, 1, head_size, dtype=torch.uint8)
    cache[1:, 1, 0, 0] = rows
    cache = cache.view(FP8)
    table = torch.arange(1, n + 1, dtype=torch.int32).view(n, 1)
    lens = torch.ones(n, dtype=torch.int32)
    out = cpu_kernels.paged_decode(torch.randn(n, 1, head_size), cache, table, lens, 1.0, None)
    torch.testing.assert_close(out[:, 0], rows.view(FP8).float(), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [(4, 2, 8), (4, 2, 16), (9, 3, 64), (8, 2, 32), (8, 1, 128), (6, 3, 48), (2, 1, 256)],
)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("block_size", [16, 5])
def test_c_fp8_kernel_matches_torch_fp8_path(heads, kv_heads, head_size, window, block_size, kernel_build):
    """The C kernel on fp8 pages (through `attend`: the fp8 write of this step's K/V included, with
    non-unit scales) against the torch gather path on the same pages, in float32."""
    torch.manual_seed(head_size + heads + block_size)
    lens = [1, 5, 16, 17, 300, 700]
    tables, first = decode_tables(lens, block_size)
    cache = quantize_fp8(4 * torch.randn(first, 2, block_size, kv_heads, head_size), 1.0)
    q = torch.randn(len(lens), heads, head_size)
    k, v = (torch.randn(len(lens), kv_heads, head_size) for _ in range(2))
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    attn.k_scale, attn.v_scale = 0.25, 2.0  # per-tensor scales reach both paths

    def run(c_kernel: bool) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
            meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
            return attn.attend(q, k, v, cache.clone(), meta)

    fast, ref = run(True), run(False)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


def _steps_through(cache: torch.Tensor, attn: Attention, block_size: int, seed: int) -> torch.Tensor:
    """Prefill chunks (one fresh, one after cached tokens) then decodes of 4 requests; all outputs."""
    gen = torch.Generator().manual_seed(seed)
    lens = [0, 0, 0, 0]
    tables = [list(range(1 + 12 * r, 13 + 12 * r)) for r in range(4)]
    outs = []
    for step in ([40, 7, 90, 1], [30, 1, 1, 25], [1, 1, 1, 1], [1, 1, 1, 1]):
        meta = build_attention_metadata(tables, lens, step, block_size)
        q = torch.randn(sum(step), attn.num_heads, attn.head_size, generator=gen)
        k, v = (torch.randn(sum(step), attn.num_kv_heads, attn.head_size, generator=gen) for _ in range(2))
        outs.append(attn.attend(q, k, v, cache, meta))
        lens = [a + b for a, b in zip(lens, step, strict=True)]
    return torch.cat(outs)


@pytest.mark.parametrize("c_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("window", [None, 24])
def test_fp8_attention_close_to_float32_and_bf16(c_kernel, window, monkeypatch):
    """Against float32 pages the fp8 outputs differ by e4m3's rounding (3 mantissa bits: relative error
    up to 2^-4 per value, 16x bf16's), averaged by attention. Unit-variance q, K, V, 4 requests of
    up to 123 tokens (fresh prefill chunks read float K/V, later chunks and decodes the pages):
    measured max |diff| 0.12-0.135, mean 0.0026-0.0031 (bf16 pages: max 0.008-0.009, mean 0.0002),
    the same for the C kernel and the torch path. Bounds: max 0.2, mean 0.005, mean <= 24x bf16's."""
    if c_kernel and cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
    block_size, kvh, d = 16, 2, 64
    attn = Attention(8, kvh, d, d**-0.5, sliding_window=window)
    outs = {
        dtype: _steps_through(allocate_kv_cache(50, block_size, kvh, d, dtype), attn, block_size, seed=3)
        for dtype in (torch.float32, torch.bfloat16, FP8)
    }
    ref = outs[torch.float32]
    err8 = (outs[FP8] - ref).abs()
    err16 = (outs[torch.bfloat16] - ref).abs()
    assert torch.isfinite(outs[FP8]).all()
    assert err8.max() < 0.2 and err8.mean() < 0.005, (err8.max(), err8.mean())
    assert err8.mean() < 24 * err16.mean(), (err8.mean(), err16.mean())


def test_fp8_specs_halve_the_page_and_double_the_pool():
    def spec(cache_dtype: str) -> FullAttentionSpec:
        attn = Attention(8, 2, 64, 0.125)
        return attn.get_kv_cache_spec(CacheConfig(block_size=16, cache_dtype=cache_dtype), "bfloat16")

    bf16, fp8, f32 = spec("auto"), spec("fp8_e4m3"), spec("float32")
    assert (bf16.dtype, fp8.dtype, spec("fp8").dtype, f32.dtype) == (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fn",
        "float32",
    )
    assert 2 * fp8.page_size_bytes == bf16.page_size_bytes == f32.page_size_bytes // 2
    memory = 64 << 20
    blocks = {
        s.dtype: get_kv_cache_config(
            {f"l{i}": s for i in range(4)}, available_memory_bytes=memory, num_blocks=None, max_model_len=256
        ).num_blocks
        for s in (bf16, fp8)
    }
    assert blocks["float8_e4m3fn"] == 2 * blocks["bfloat16"]


def test_bad_kv_cache_dtype_is_refused():
    assert set(KV_CACHE_DTYPE_CHOICES) == set(KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(cache_dtype="fp16x")
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype"):
        kv_cache_dtype_name("fp16x", "bfloat16")
    assert kv_cache_dtype_name("auto", "float32") == "float32"
