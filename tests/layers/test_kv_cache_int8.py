"""INT8 KV pages: the symmetric write rounds and clamps, the C decode kernel (native and AVX2 builds) reads
the bytes exactly as torch converts them, int8 attention stays close to float32 attention, the scales are
calibrated once from the first forward that writes real tokens (never from one writing the null block
alone), fp8 calibrates only when asked, and the pool holds twice the tokens of bf16."""

from __future__ import annotations

import pytest
import torch

import tokenos.layers.attention as attention
from tests.layers.test_attention import decode_tables
from tests.layers.test_kv_cache_fp8 import _steps_through
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import get_kv_cache_config
from tokenos.layers import cpu_kernels
from tokenos.layers.attention import (
    FP8_K_SCALE_CONSTANT,
    FP8_V_SCALE_CONSTANT,
    INT8_MAX,
    KV_HEADROOM,
    Attention,
    allocate_kv_cache,
    quantize_int8,
)
from tokenos.layers.attention_metadata import build_attention_metadata

INT8 = torch.int8


def test_quantize_int8_rounds_symmetrically_and_clamps():
    x = torch.tensor([0.0, 0.26, -0.26, 0.74, 12.7, 13.0, -100.0, float("inf"), -float("inf"), float("nan")])
    q = quantize_int8(x, 0.1)
    assert q.dtype == INT8
    assert q.tolist() == [0, 3, -3, 7, 127, 127, -127, 127, -127, 0]  # never -128: +-x keep one magnitude
    assert quantize_int8(torch.tensor([0.5, 1.5, 2.5]), 1.0).tolist() == [0, 2, 2]  # torch rounds half even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_int8_write_matches_torch_quantize_bit_for_bit(dtype, kernel_build):
    """The C write (one call for K and V) stores exactly what `quantize_int8` makes, rounding ties to
    even, clamping, NaN as 0, from K and V that are strided views of one fused projection, into rows
    of the pages in any order; other rows stay untouched."""
    torch.manual_seed(4)
    n, kvh, d, scale_k, scale_v = 37, 3, 48, 0.0625, 0.05  # K: exact halves (ties) in bf16 too
    qkv = (8 * torch.randn(n, 2 * kvh * d + 5)).to(dtype)
    k = qkv[:, : kvh * d].view(n, kvh, d)
    v = qkv[:, kvh * d : 2 * kvh * d].view(n, kvh, d)
    k[0, 0, :6] = torch.tensor([0.03125, 0.09375, -0.03125, float("nan"), float("inf"), -1e9]).to(dtype)
    flat = torch.full((200, kvh, d), 99, dtype=INT8)
    rows = torch.randperm(200)[: 2 * n]
    cpu_kernels.kv_write_8bit(k, v, flat, rows, scale_k, scale_v)
    assert torch.equal(flat[rows[:n]], quantize_int8(k, scale_k))
    assert torch.equal(flat[rows[n:]], quantize_int8(v, scale_v))
    assert flat[rows[0], 0, :6].tolist() == [0, 2, 0, 0, 127, -127]  # ties to even: 0.5 -> 0, 1.5 -> 2
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[rows] = False
    assert (flat[untouched] == 99).all()


@pytest.mark.parametrize("head_size", [256, 8])
def test_c_kernel_widens_every_int8_value_exactly(head_size, kernel_build):
    """One cached token per request: softmax weight 1, so the output is that token's V row widened by
    the kernel, every int8 value (-128 included) as torch converts it. head_size 256: the AVX-512 tile
    path where built; 8: the generic loop."""
    rows = torch.arange(-128, 128, dtype=torch.int16).to(INT8).view(-1, head_size)
    n = rows.shape[0]
    cache = torch.zeros(n + 1, 2, 1, 1, head_size, dtype=INT8)
    cache[1:, 1, 0, 0] = rows
    table = torch.arange(1, n + 1, dtype=torch.int32).view(n, 1)
    lens = torch.ones(n, dtype=torch.int32)
    out = cpu_kernels.paged_decode(torch.randn(n, 1, head_size), cache, table, lens, 1.0, None, 1.0, 0.5)
    torch.testing.assert_close(out[:, 0], rows.float() * 0.5, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [(4, 2, 8), (4, 2, 16), (9, 3, 64), (8, 2, 32), (8, 1, 128), (6, 3, 48), (2, 1, 256)],
)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("block_size", [16, 5])
def test_c_int8_kernel_matches_torch_int8_path(heads, kv_heads, head_size, window, block_size, kernel_build):
    """The C kernel on int8 pages (through `attend`: the calibration and int8 write of this step's K/V
    included) against the torch gather path on the same pages, in float32."""
    torch.manual_seed(head_size + heads + block_size)
    lens = [1, 5, 16, 17, 300, 700]
    tables, first = decode_tables(lens, block_size)
    cache = torch.randint(-127, 128, (first, 2, block_size, kv_heads, head_size), dtype=INT8)
    q = torch.randn(len(lens), heads, head_size)
    k, v = (torch.randn(len(lens), kv_heads, head_size) for _ in range(2))

    def run(c_kernel: bool) -> tuple[torch.Tensor, tuple[float, float]]:
        attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
            meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
            return attn.attend(q, k, v, cache.clone(), meta), (attn.k_scale, attn.v_scale)

    (fast, fast_scales), (ref, ref_scales) = run(True), run(False)
    assert fast_scales == ref_scales and fast_scales[0] != 1.0
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("c_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("window", [None, 24])
def test_int8_attention_close_to_float32_and_bf16(c_kernel, window, monkeypatch):
    """Against float32 pages, int8 pages (scales calibrated on the first step: 2 * amax / 127, a step
    of about 0.07 for unit-variance K/V) differ by their uniform rounding (+-half a step), averaged by
    attention. Same steps as the fp8 test (4 requests of up to 123 tokens, prefill chunks then decodes):
    measured max |diff| 0.065, mean 0.0022-0.0026 (fp8 pages: max 0.123, mean 0.0027-0.0031), the same
    for the C kernel and the torch path: on unit-variance values int8's uniform step under 2x headroom
    is only a little finer than e4m3's relative one. Bounds: max 0.09, mean 0.003, mean under 0.9x
    fp8's."""
    if c_kernel and cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
    block_size, kvh, d = 16, 2, 64
    outs = {}
    for dtype in (torch.float32, torch.float8_e4m3fn, INT8):
        attn = Attention(8, kvh, d, d**-0.5, sliding_window=window)
        cache = allocate_kv_cache(50, block_size, kvh, d, dtype)
        outs[dtype] = _steps_through(cache, attn, block_size, seed=3)
    ref = outs[torch.float32]
    err8 = (outs[INT8] - ref).abs()
    errf8 = (outs[torch.float8_e4m3fn] - ref).abs()
    assert torch.isfinite(outs[INT8]).all()
    assert err8.max() < 0.09 and err8.mean() < 0.003, (err8.max(), err8.mean())
    assert err8.mean() < 0.9 * errf8.mean(), (err8.mean(), errf8.mean())


@pytest.mark.parametrize("padded", [False, True])
def test_c_int8_write_fills_pages_as_the_torch_write(padded, monkeypatch):
    """Prefill chunks and decodes through `attend` with the C int8 write and with torch's: the same page
    bytes (padding rows of hybrid-style pages untouched) and the same outputs."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    block_size, kvh, d, num_blocks = 16, 2, 64, 50

    def run(c_write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pages = torch.full((num_blocks, 2 * block_size + (3 if padded else 0), kvh, d), 7, dtype=INT8)
        cache = pages[:, : 2 * block_size].view(num_blocks, 2, block_size, kvh, d)
        assert cache.is_contiguous() != padded
        attn = Attention(8, kvh, d, d**-0.5)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "_use_c_kv_write", lambda k, v: c_write and cpu_kernels.usable(k, v))
            return _steps_through(cache, attn, block_size, seed=5), pages

    (out_c, pages_c), (out_t, pages_t) = run(True), run(False)
    assert torch.equal(pages_c, pages_t)
    assert (pages_c[:, 2 * block_size :] == 7).all()
    torch.testing.assert_close(out_c, out_t, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["softcap", "sinks"])
def test_explicit_attention_reads_int8_pages(kind):
    """Layers with Gemma 2's logit soft cap or gpt-oss's sinks (the C decode kernel, the explicit torch path
    for float32 prefills) read int8 pages too: close to the same layer over float32 pages (bounds as the
    fused paths')."""
    block_size, kvh, d = 16, 2, 64
    outs = {}
    for dtype in (torch.float32, INT8):
        extra = {"logit_softcap": 20.0} if kind == "softcap" else {"sinks": torch.linspace(-1, 1, 8)}
        attn = Attention(8, kvh, d, d**-0.5, **extra)
        outs[dtype] = _steps_through(
            allocate_kv_cache(50, block_size, kvh, d, dtype), attn, block_size, seed=6
        )
    err = (outs[INT8] - outs[torch.float32]).abs()
    assert err.max() < 0.09 and err.mean() < 0.003, (err.max(), err.mean())


def _forward(attn: Attention, cache: torch.Tensor, tables, computed, scheduled, block_size, k_gain=1.0):
    """One `attend` step of random q, K (times k_gain), V over ``cache``."""
    n = sum(scheduled)
    q = torch.randn(n, attn.num_heads, attn.head_size)
    k = k_gain * torch.randn(n, attn.num_kv_heads, attn.head_size)
    v = torch.randn(n, attn.num_kv_heads, attn.head_size)
    meta = build_attention_metadata(tables, computed, scheduled, block_size)
    return attn.attend(q, k, v, cache, meta), k, v


def test_int8_scales_calibrated_once_from_the_first_real_forward():
    """The first forward writing real pages fixes k_scale = 2 amax(K) / 127 and v_scale = 2 amax(V) / 127
    before it writes; a later forward with 3x larger K changes nothing (its outliers clip)."""
    torch.manual_seed(0)
    attn = Attention(4, 2, 16, 0.25)
    cache = allocate_kv_cache(8, 16, 2, 16, INT8)
    assert not attn.kv_scales_calibrated
    _, k, v = _forward(attn, cache, [[1, 2]], [0], [20], 16)
    assert attn.kv_scales_calibrated
    assert attn.k_scale == pytest.approx(KV_HEADROOM * k.abs().max().item() / INT8_MAX)
    assert attn.v_scale == pytest.approx(KV_HEADROOM * v.abs().max().item() / INT8_MAX)
    # What was written reads back within half a step.
    stored = cache[1, 0].float() * attn.k_scale
    assert (stored - k[:16]).abs().max() <= attn.k_scale / 2 + 1e-6
    scales = (attn.k_scale, attn.v_scale)
    _forward(attn, cache, [[1, 2]], [20], [1], 16, k_gain=3.0)
    _forward(attn, cache, [[3]], [0], [9], 16, k_gain=3.0)
    assert (attn.k_scale, attn.v_scale) == scales
    assert cache[3, 0].abs().max() == 127  # the larger K saturates instead of rescaling the layer


def test_a_warm_up_on_the_null_block_does_not_calibrate():
    """A dummy forward whose tokens all go to the null block (page 0, where padding lives) leaves the
    scales open; so does one whose real K and V are all zero (zeros read back the same under any scale),
    for each of K and V. The next real forward calibrates from its own tokens alone."""
    torch.manual_seed(1)
    attn = Attention(4, 2, 16, 0.25)
    cache = allocate_kv_cache(8, 16, 2, 16, INT8)
    _forward(attn, cache, [[0]], [0], [12], 16, k_gain=100.0)  # warm-up garbage into page 0
    assert not attn.kv_scales_calibrated and attn.k_scale == 1.0
    n = 5
    meta = build_attention_metadata([[1]], [0], [n], 16)
    zeros = torch.zeros(n, 2, 16)
    attn.attend(torch.randn(n, 4, 16), zeros, zeros, cache, meta)
    assert not attn.kv_scales_calibrated and attn.k_scale == 1.0
    # Zero K beside real V: V's scale is fixed by this step (its values are written with it), K's waits.
    v_first = torch.randn(n, 2, 16)
    attn.attend(torch.randn(n, 4, 16), zeros, v_first, cache, build_attention_metadata([[4]], [0], [n], 16))
    assert not attn.kv_scales_calibrated and attn.k_scale == 1.0
    assert attn.v_scale == pytest.approx(KV_HEADROOM * v_first.abs().max().item() / INT8_MAX)
    v_scale = attn.v_scale
    # One step mixing a null-block write with real ones: only the real tokens count.
    q = torch.randn(10, 4, 16)
    k = torch.randn(10, 2, 16)
    k[:4] *= 100.0
    v = torch.randn(10, 2, 16)
    meta = build_attention_metadata([[0], [2]], [0, 0], [4, 6], 16)
    attn.attend(q, k, v, cache, meta)
    assert attn.kv_scales_calibrated
    assert attn.k_scale == pytest.approx(KV_HEADROOM * k[4:].abs().max().item() / INT8_MAX)
    assert attn.v_scale == v_scale


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_scales_stay_1_unless_asked(calculate):
    """fp8 pages keep today's 1.0 scales; with calculate_kv_scales (vLLM's flag) the first real forward
    sets vLLM's amax(K) / 200 and amax(V) / 100, once."""
    torch.manual_seed(2)
    attn = Attention(4, 2, 16, 0.25)
    attn.calculate_kv_scales = calculate
    cache = allocate_kv_cache(8, 16, 2, 16, torch.float8_e4m3fn)
    _, k, v = _forward(attn, cache, [[1]], [0], [10], 16)
    if not calculate:
        assert (attn.k_scale, attn.v_scale) == (1.0, 1.0) and not attn.kv_scales_calibrated
        return
    assert attn.k_scale == pytest.approx(k.abs().max().item() / FP8_K_SCALE_CONSTANT)
    assert attn.v_scale == pytest.approx(v.abs().max().item() / FP8_V_SCALE_CONSTANT)
    scales = (attn.k_scale, attn.v_scale)
    _forward(attn, cache, [[2]], [0], [10], 16, k_gain=5.0)
    assert (attn.k_scale, attn.v_scale) == scales


def test_int8_specs_halve_the_page_and_double_the_pool():
    def spec(cache_dtype: str):
        attn = Attention(8, 2, 64, 0.125)
        return attn.get_kv_cache_spec(CacheConfig(block_size=16, cache_dtype=cache_dtype), "bfloat16")

    bf16, int8 = spec("auto"), spec("int8")
    assert int8.dtype == "int8"
    assert 2 * int8.page_size_bytes == bf16.page_size_bytes
    memory = 64 << 20
    blocks = [
        get_kv_cache_config(
            {f"l{i}": s for i in range(4)}, available_memory_bytes=memory, num_blocks=None, max_model_len=256
        ).num_blocks
        for s in (bf16, int8)
    ]
    assert blocks[1] == 2 * blocks[0]
