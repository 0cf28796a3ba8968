"""The C prefill kernel (csrc/prefill_attention.c) against the torch path (SDPA over gathered pages)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenos.layers import cpu_kernels
from tokenos.layers.attention import Attention, quantize_int8
from tokenos.layers.attention_metadata import build_attention_metadata


def _step(rng: random.Random, chunks: list[tuple[int, int]], block_size: int):
    """Block tables (pages in a shuffled order) for requests of (cached tokens, new tokens)."""
    pages = list(range(1, 1 + sum(-(-(c + n) // block_size) for c, n in chunks)))
    rng.shuffle(pages)
    tables = []
    for c, n in chunks:
        count = -(-(c + n) // block_size)
        tables.append(pages[:count])
        pages = pages[count:]
    return tables, 1 + sum(len(t) for t in tables)


def _run(attn, q, k, v, cache, tables, chunks, block_size, c_prefill, monkeypatch):
    monkeypatch.setattr(Attention, "_use_c_prefill", lambda self, q, kv_cache: c_prefill)
    meta = build_attention_metadata(tables, [c for c, _ in chunks], [n for _, n in chunks], block_size)
    return attn.attend(q, k, v, cache, meta).float()


def _qkv(tokens: int, heads: int, kv_heads: int, d: int):
    """q, k, v as views of one fused projection output (q has a token stride wider than its row)."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(torch.bfloat16)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [
        (9, 3, 64),
        (4, 2, 32),
        (8, 1, 128),
        (4, 4, 64),
        (16, 1, 64),
        (2, 1, 256),
        (6, 2, 96),
        (3, 1, 16),
        (4, 2, 80),
    ],
)
@pytest.mark.parametrize("window", [None, 37, 100])
def test_prefill_kernel_matches_torch_path(heads, kv_heads, head_size, window, monkeypatch):
    """Chunks of every kind in one step (fresh, after a prefix, shorter and longer than a tile, prefixes
    off the tile grid) beside decodes, against float32 SDPA over the same bf16 values."""
    if not cpu_kernels.prefill_supported(heads, kv_heads, head_size):
        pytest.skip("the C prefill kernel needs AVX512-BF16 and a supported head shape")
    rng = random.Random(head_size * 7 + heads + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    block_size = 16
    chunks = [(0, 2), (0, 17), (5, 1), (16, 16), (33, 50), (0, 300), (500, 40), (7, 1), (90, 129)]
    tables, num_pages = _step(rng, chunks, block_size)
    cache = torch.randn(num_pages, 2, block_size, kv_heads, head_size).to(torch.bfloat16)
    tokens = sum(n for _, n in chunks)
    q, k, v = _qkv(tokens, heads, kv_heads, head_size)
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    fast = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
    # Reference: the torch path in float32 over the same bf16 values.
    ref = _run(
        attn, q.float(), k.float(), v.float(), cache.float(), tables, chunks, block_size, False, monkeypatch
    )
    torch.testing.assert_close(fast, ref, atol=1.5e-2, rtol=2e-2)
    # And no further from the reference than the bf16 torch path (SDPA in bf16) is.
    slow = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, False, monkeypatch)
    assert (fast - ref).abs().mean() <= 1.5 * (slow - ref).abs().mean() + 1e-4


def _eight_bit_step(heads: int, kv_heads: int, head_size: int, window: int | None):
    """The 8-bit page tests' step (skipped where the kernel does not run): (chunks, block tables, pages,
    block size), seeded by the shape."""
    if not cpu_kernels.prefill_supported(heads, kv_heads, head_size):
        pytest.skip("the C prefill kernel needs AVX512-BF16 and a supported head shape")
    rng = random.Random(head_size + heads + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    block_size = 16
    chunks = [(0, 17), (5, 1), (16, 16), (33, 50), (0, 300), (90, 129)]
    tables, num_pages = _step(rng, chunks, block_size)
    return chunks, tables, num_pages, block_size


@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (4, 2, 32), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_prefill_kernel_reads_fp8_pages(heads, kv_heads, head_size, window, monkeypatch):
    """fp8 (e4m3fn) pages, widened to bf16 as the kernel packs them: against float32 SDPA over the same
    fp8 values (the fresh K/V given already rounded to fp8, since the kernel reads them from the pages)."""
    chunks, tables, num_pages, block_size = _eight_bit_step(heads, kv_heads, head_size, window)
    cache = torch.randn(num_pages, 2, block_size, kv_heads, head_size).to(torch.float8_e4m3fn)
    q, k, v = _qkv(sum(n for _, n in chunks), heads, kv_heads, head_size)
    k8, v8 = (t.float().to(torch.float8_e4m3fn).float() for t in (k, v))
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    fast = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
    ref = _run(attn, q.float(), k8, v8, cache.float(), tables, chunks, block_size, False, monkeypatch)
    torch.testing.assert_close(fast, ref, atol=1.5e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"), [(9, 3, 64), (4, 2, 32), (8, 1, 128), (4, 2, 80)]
)
@pytest.mark.parametrize("window", [None, 37])
def test_prefill_kernel_reads_int8_pages(heads, kv_heads, head_size, window, monkeypatch):
    """int8 pages, widened to bf16 as the kernel packs them (exact) and read with the layer's scales
    (folded into the softmax scale and the output): against float32 SDPA over the same dequantized
    values (the fresh K/V given already through the int8 write, since the kernel reads them from the
    pages). The scales are calibrated by the step itself, as in the engine's first forward."""
    chunks, tables, num_pages, block_size = _eight_bit_step(heads, kv_heads, head_size, window)
    cache = torch.randint(-127, 128, (num_pages, 2, block_size, kv_heads, head_size), dtype=torch.int8)
    q, k, v = _qkv(sum(n for _, n in chunks), heads, kv_heads, head_size)
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    fast = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
    ks, vs = attn.k_scale, attn.v_scale
    assert attn.kv_scales_calibrated and ks != 1.0
    k8, v8 = quantize_int8(k, ks).float() * ks, quantize_int8(v, vs).float() * vs
    ref_attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    ref_cache = cache.float()
    ref_cache[:, 0] *= ks
    ref_cache[:, 1] *= vs
    ref = _run(ref_attn, q.float(), k8, v8, ref_cache, tables, chunks, block_size, False, monkeypatch)
    torch.testing.assert_close(fast, ref, atol=1.5e-2, rtol=2e-2)


def test_prefill_kernel_writes_only_prefill_rows_and_reads_pages_in_place(monkeypatch):
    """The pages hold the only copy of a chunk's prefix: poisoning a page the chunk never maps must not
    change its output, and decode rows of the step are left to the decode path."""
    if not cpu_kernels.prefill_supported(9, 3, 64):
        pytest.skip("the C prefill kernel needs AVX512-BF16")
    torch.manual_seed(0)
    block_size = 16
    chunks = [(40, 24), (3, 1)]
    tables = [[5, 2, 7, 9], [4]]
    cache = torch.randn(12, 2, block_size, 3, 64).to(torch.bfloat16)
    q, k, v = _qkv(25, 9, 3, 64)
    attn = Attention(9, 3, 64, 0.125)
    first = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
    poisoned = cache.clone()
    poisoned[[1, 3, 6, 8, 10, 11]] = float("nan")
    second = _run(attn, q, k, v, poisoned, tables, chunks, block_size, True, monkeypatch)
    assert torch.equal(first, second)
    assert torch.isfinite(first).all()


@pytest.mark.skipif(not cpu_kernels.uses_amx(), reason="no AMX-BF16 (or the OS refused its tiles)")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"), [(9, 3, 64), (8, 1, 128), (4, 2, 32), (6, 2, 96)]
)
@pytest.mark.parametrize("window", [None, 37])
def test_amx_prefill_matches_the_avx512_prefill(heads, kv_heads, head_size, window, monkeypatch):
    """The tile path multiplies the same packed bf16 operands as the AVX-512 one, in float32, and applies
    the same masks and softmax: the outputs differ only by the order of the float32 sums (and then by
    a bf16 rounding of the result), for head sizes in 32s; every row count modulo 16 occurs."""
    chunks, tables, num_pages, block_size = _eight_bit_step(heads, kv_heads, head_size, window)
    cache = torch.randn(num_pages, 2, block_size, kv_heads, head_size).to(torch.bfloat16)
    q, k, v = _qkv(sum(n for _, n in chunks), heads, kv_heads, head_size)
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)
    allowed = cpu_kernels.uses_amx()
    try:
        cpu_kernels.set_amx(False)
        avx = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
        cpu_kernels.set_amx(True)
        amx = _run(attn, q, k, v, cache.clone(), tables, chunks, block_size, True, monkeypatch)
    finally:
        cpu_kernels.set_amx(allowed)
    # One bf16 ulp of the output's magnitude: the two sums round to neighbouring bf16 values at most.
    assert (amx - avx).abs().max().item() <= 2**-7 * max(1.0, avx.abs().max().item())
    assert (amx - avx).abs().mean().item() <= 1e-3
    assert not torch.equal(amx, torch.zeros_like(amx))


def _shared_prefix_step(heads: int, kv_heads: int, d: int):
    """A step of five chunks: three over 20 shared pages (320 cached tokens: 256 of them two whole
    softmax blocks of 128 keys), one with 300 cached tokens of its own, a fresh one. Returns (the
    shared pages, a source of unused pages, block table, chunks, cache, q)."""
    bs = 16
    shared = list(range(1, 21))
    own = iter(range(21, 200))

    def table(cached: int, new: int, common: list[int]) -> list[int]:
        n = -(-(cached + new) // bs)
        return common[:n] + [next(own) for _ in range(n - min(n, len(common)))]

    spec = [(320, 24, shared), (320, 1, shared), (300, 40, []), (320, 40, shared), (0, 70, [])]
    tables = [table(c, n, common) for c, n, common in spec]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [sum(n for _, n, _ in spec[:i]) for i in range(len(spec))]
    chunks = torch.tensor([[s, n, c] for s, (c, n, _) in zip(starts, spec, strict=True)], dtype=torch.int32)
    cache = torch.randn(200, 2, bs, kv_heads, d).to(torch.bfloat16)
    q = torch.randn(sum(n for _, n, _ in spec), heads, d).to(torch.bfloat16)
    return shared, own, block_table, chunks, cache, q


def _prefill(q, cache, block_table, chunks, pages, rows: slice = slice(None)) -> torch.Tensor:
    out = torch.zeros_like(q)
    d = q.shape[2]
    table, step = block_table[rows], chunks[rows]
    cpu_kernels.paged_prefill(q, cache, table, step, d**-0.5, None, out, page_epochs=pages)
    return out


@pytest.fixture
def cascade_cache():
    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()
    yield
    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(9, 3, 64), (8, 1, 128), (4, 2, 32)])
def test_prefill_reads_shared_prefixes_from_the_packed_prefix_cache(
    heads, kv_heads, head_size, amx, cascade_cache
):
    """With page epochs, a cached prefix that chunks of a step share is packed once into the
    packed-prefix cache (its whole blocks of 128 keys; the rest with each chunk) and read from there, by
    this step and later ones: the same bits as packing it with every chunk, as the softmax blocks fall
    at the same keys. A prefix of one chunk's own is not kept; a page whose epoch moved is packed again
    from its new content."""
    from tokenos.worker.kv_cache import PageEpochs

    if not cpu_kernels.prefill_supported(heads, kv_heads, head_size) or not cpu_kernels.uses_cascade():
        pytest.skip("the C prefill kernel and the packed-prefix cache need AVX512-BF16")
    if amx and not cpu_kernels.uses_amx():
        pytest.skip("no AMX-BF16 (or the OS refused its tiles)")
    torch.manual_seed(11)
    shared, _, block_table, chunks, cache, q = _shared_prefix_step(heads, kv_heads, head_size)
    epochs = PageEpochs(cache.shape[0])
    allowed = cpu_kernels.uses_amx()
    cpu_kernels.set_amx(amx)
    try:
        fresh = _prefill(q, cache, block_table, chunks, None)
        assert cpu_kernels.cascade_cache_stats()["entries"] == 0
        assert torch.equal(_prefill(q, cache, block_table, chunks, epochs.epochs), fresh)
        stats = cpu_kernels.cascade_cache_stats()
        assert (stats["entries"], stats["misses"]) == (1, 1)  # the shared prefix only, packed once
        assert torch.equal(_prefill(q, cache, block_table, chunks, epochs.epochs), fresh)  # found whole
        assert cpu_kernels.cascade_cache_stats()["hits"] == 1
        # One chunk alone over the shared pages: the entry serves it too.
        start, new = chunks[3, 0].item(), chunks[3, 1].item()
        alone = _prefill(q, cache, block_table, chunks, epochs.epochs, slice(3, 4))
        assert torch.equal(alone[start : start + new], fresh[start : start + new])
        assert cpu_kernels.cascade_cache_stats()["hits"] == 2
        # New content in a shared page, its epoch moved: packed again, as a fresh call sees it.
        cache[shared[3]] = torch.randn_like(cache[shared[3]])
        epochs.bump([shared[3]])
        moved = _prefill(q, cache, block_table, chunks, epochs.epochs)
        assert torch.equal(moved, _prefill(q, cache, block_table, chunks, None))
        assert not torch.equal(moved, fresh)
    finally:
        cpu_kernels.set_amx(allowed)


def test_prefill_reads_a_decode_groups_packed_prefix(cascade_cache):
    """A decode group's packed prefix (cascade attention's entry) serves a later prefill chunk over the
    same pages, with the bits of packing them afresh."""
    from tokenos.worker.kv_cache import PageEpochs

    if not cpu_kernels.prefill_supported(9, 3, 64) or not cpu_kernels.uses_cascade():
        pytest.skip("the C prefill kernel and the packed-prefix cache need AVX512-BF16")
    torch.manual_seed(12)
    shared, own, block_table, chunks, cache, q = _shared_prefix_step(9, 3, 64)
    epochs = PageEpochs(cache.shape[0])
    table = torch.tensor([shared + [next(own)], shared + [next(own)]], dtype=torch.int32)
    lens = torch.tensor([330, 335], dtype=torch.int32)
    dq = torch.randn(2, 9, 64)
    cpu_kernels.paged_decode(dq, cache, table, lens, 0.125, None, page_epochs=epochs.epochs)
    assert cpu_kernels.cascade_cache_stats()["entries"] == 1
    one = _prefill(q, cache, block_table, chunks, epochs.epochs, slice(0, 1))
    assert cpu_kernels.cascade_cache_stats()["hits"] == 1
    new = chunks[0, 1].item()
    assert torch.equal(one[:new], _prefill(q, cache, block_table, chunks, None)[:new])
