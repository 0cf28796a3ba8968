"""The C attention kernels' soft cap (Gemma 2) and sinks (gpt-oss) against `softcap_attention`, the explicit
torch reference: the decode kernel (csrc/paged_attention.c) over float32, bf16, fp8 and int8 pages, on the
AVX-512 and the AVX2 build, with requests long enough to be cut into splits; the prefill kernel
(csrc/prefill_attention.c) over bf16, fp8 and int8 pages, with cached prefixes and windows; and an
`Attention` with a cap or sinks reaching the kernels."""

from __future__ import annotations

import random

import pytest
import torch

from tokenos.layers import cpu_kernels
from tokenos.layers.attention import Attention, dequantize, quantize_kv, softcap_attention
from tokenos.layers.attention_metadata import build_attention_metadata

PAGE_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
K_SCALE, V_SCALE = 0.03, 0.02  # of the 8-bit pages: values of randn / scale fit both formats


def _pages(rng: random.Random, lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables over shuffled pages (page 0 left as the null block) for sequences of ``lens`` tokens."""
    counts = [-(-n // block_size) for n in lens]
    pages = list(range(1, 1 + sum(counts)))
    rng.shuffle(pages)
    tables = []
    for c in counts:
        tables.append(pages[:c])
        pages = pages[c:]
    return tables, 1 + sum(counts)


def _cache(num_pages: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype):
    """Random pages of ``dtype`` and their values as float32 (what the kernels must read them as)."""
    values = torch.randn(num_pages, 2, block_size, kv_heads, d)
    if dtype in (torch.float8_e4m3fn, torch.int8):
        cache = torch.cat(
            (quantize_kv(values[:, :1], dtype, K_SCALE), quantize_kv(values[:, 1:], dtype, V_SCALE)), dim=1
        )
        exact = torch.cat(
            (
                dequantize(cache[:, :1], torch.float32, K_SCALE),
                dequantize(cache[:, 1:], torch.float32, V_SCALE),
            ),
            dim=1,
        )
        return cache, exact
    cache = values.to(dtype)
    return cache, cache.float()


def _gather(exact: torch.Tensor, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [1, KVH, length, D] of one sequence."""
    kv = exact[table].transpose(0, 1).reshape(2, -1, *exact.shape[3:])[:, :length]
    return kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)


def _sinks(heads: int, on: bool) -> torch.Tensor | None:
    # Around the scores' range (|s| ~ 1-3), one far above it so the sink dominates and raises the max.
    return torch.linspace(-2.0, 3.0, heads).index_fill_(0, torch.tensor([0]), 12.0) if on else None


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"),
    [(8, 2, 64), (4, 4, 128), (8, 1, 64), (6, 2, 256), (4, 2, 256), (20, 1, 32), (4, 2, 80)],
)
@pytest.mark.parametrize("page_dtype", PAGE_DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize(("cap", "with_sinks"), [(None, True), (5.0, False), (2.0, True)])
def test_decode_kernel_matches_reference(kernel_build, heads, kv_heads, d, page_dtype, cap, with_sinks):
    """Vector items (whole request, G <= 4) and portable items (larger groups, head chunks of 16, head sizes
    off the vector grid), one split and several (a 700-token request), with and without a window."""
    rng = random.Random(heads * 1000 + d + PAGE_DTYPES.index(page_dtype))
    torch.manual_seed(rng.randrange(1 << 30))
    block_size = 16
    lens = [1, 37, 700, 129]
    tables, num_pages = _pages(rng, lens, block_size)
    cache, exact = _cache(num_pages, block_size, kv_heads, d, page_dtype)
    # Larger scores, so the cap bends them; bf16 values, as the model's q (the AVX512-BF16 item rounds q).
    q = (torch.randn(len(lens), heads, d) * 2.0).bfloat16().float()
    # bf16 pages on AVX512-BF16 also round the probabilities to bf16 for P V (as torch's bf16 attention).
    atol, rtol = (3e-3, 1e-2) if page_dtype == torch.bfloat16 else (2e-5, 2e-4)
    table = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    sinks = _sinks(heads, with_sinks)
    scaled = page_dtype in (torch.float8_e4m3fn, torch.int8)
    k_scale, v_scale = (K_SCALE, V_SCALE) if scaled else (1.0, 1.0)
    scale = d**-0.5
    for window in (None, 50):
        out = cpu_kernels.paged_decode(q, cache, table, seq_lens, scale, window, k_scale, v_scale, cap, sinks)
        for r, n in enumerate(lens):
            k, v = _gather(exact, tables[r], n)
            if window is not None:
                k, v = k[:, :, -window:], v[:, :, -window:]
            s = None if sinks is None else sinks.view(1, heads, 1, 1)
            ref = softcap_attention(q[r].view(1, heads, 1, d), k, v, None, scale, cap, s)[0, :, 0]
            torch.testing.assert_close(
                out[r], ref, atol=atol, rtol=rtol, msg=lambda m, r=r: f"request {r}: {m}"
            )


def test_decode_with_no_visible_token_is_zero_with_sinks(kernel_build):
    """A zero-length sequence (nothing visible) gives zeros, as the reference's softmax over the sink
    alone leaves every key probability 0."""
    cache = torch.randn(3, 2, 16, 2, 64)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    out = cpu_kernels.paged_decode(
        torch.randn(1, 4, 64),
        cache,
        table,
        torch.tensor([0], dtype=torch.int32),
        0.125,
        None,
        1.0,
        1.0,
        3.0,
        torch.ones(4),
    )
    assert torch.equal(out, torch.zeros_like(out))


def _prefill_reference(q, exact, tables, chunks, scale, window, cap, sinks):
    """Each chunk's queries (after ``ctx`` cached tokens) over its whole sequence, causal and windowed."""
    heads, outs, start = q.shape[1], [], 0
    s = None if sinks is None else sinks.view(1, heads, 1, 1)
    for table, (ctx, n) in zip(tables, chunks, strict=True):
        k, v = _gather(exact, table, ctx + n)
        pos, keys = torch.arange(ctx, ctx + n)[:, None], torch.arange(ctx + n)[None, :]
        mask = keys <= pos
        if window is not None:
            mask &= keys > pos - window
        qc = q[start : start + n].float().transpose(0, 1).unsqueeze(0)
        outs.append(softcap_attention(qc, k, v, mask, scale, cap, s)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(8, 2, 64), (4, 4, 128), (16, 1, 32), (6, 3, 256), (4, 2, 80)]
)
@pytest.mark.parametrize("page_dtype", PAGE_DTYPES[1:], ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize(("cap", "with_sinks"), [(None, True), (5.0, False), (2.0, True)])
@pytest.mark.parametrize("window", [None, 37])
def test_prefill_kernel_matches_reference(heads, kv_heads, d, page_dtype, cap, with_sinks, window):
    """Fresh chunks, chunks after cached prefixes on and off the tile grid, shorter and longer than a tile:
    bf16 queries and outputs, P rounded to bf16 for P V, so bf16-level tolerances."""
    if not cpu_kernels.prefill_supported(heads, kv_heads, d):
        pytest.skip("the C prefill kernel needs AVX512-BF16 and a supported head shape")
    rng = random.Random(heads * 100 + d + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    block_size = 16
    chunks = [(0, 3), (0, 70), (5, 2), (33, 50), (100, 19)]  # no 1-token chunk: those are decodes
    tables, num_pages = _pages(rng, [c + n for c, n in chunks], block_size)
    cache, exact = _cache(num_pages, block_size, kv_heads, d, page_dtype)
    tokens = sum(n for _, n in chunks)
    q = (torch.randn(tokens, heads, d) * 2.0).to(torch.bfloat16)
    meta = build_attention_metadata(tables, [c for c, _ in chunks], [n for _, n in chunks], block_size)
    spans, table = meta.prefill_batch()
    scaled = page_dtype in (torch.float8_e4m3fn, torch.int8)
    scale = d**-0.5
    sinks = _sinks(heads, with_sinks)
    out = torch.empty_like(q)
    cpu_kernels.paged_prefill(
        q, cache, table, spans, scale * (K_SCALE if scaled else 1.0), window, out, cap, sinks
    )
    got = out.float() * (V_SCALE if scaled else 1.0)
    ref = _prefill_reference(q, exact, tables, chunks, scale, window, cap, sinks)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert (got - ref).abs().mean() < 3e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("cap", "with_sinks"), [(4.0, False), (None, True), (3.0, True)])
def test_layer_with_cap_or_sinks_runs_the_c_kernels(dtype, cap, with_sinks, monkeypatch):
    """`Attention` with a soft cap or sinks routes its decodes (and bf16 prefills on AVX512-BF16) through the
    C kernels, and they match the same layer on its explicit torch path."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    heads, kv_heads, d, block_size = 8, 2, 64, 16
    rng = random.Random(7)
    torch.manual_seed(7)
    chunks = [(40, 1), (0, 23), (9, 1), (17, 30)]  # two decodes, a fresh prefill, a chunk after a prefix
    tables, num_pages = _pages(rng, [c + n for c, n in chunks], block_size)
    cache = torch.randn(num_pages, 2, block_size, kv_heads, d).to(dtype)
    tokens = sum(n for _, n in chunks)
    q = (torch.randn(tokens, heads, d) * 2.0).to(dtype)
    k, v = torch.randn(tokens, kv_heads, d).to(dtype), torch.randn(tokens, kv_heads, d).to(dtype)
    attn = Attention(
        heads, kv_heads, d, d**-0.5, sliding_window=20, logit_softcap=cap, sinks=_sinks(heads, with_sinks)
    )
    calls = []
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw)
        )

    def run() -> torch.Tensor:
        meta = build_attention_metadata(tables, [c for c, _ in chunks], [n for _, n in chunks], block_size)
        return attn.attend(q, k, v, cache.clone(), meta).float()

    fast = run()
    assert "paged_decode" in calls
    if dtype == torch.bfloat16 and cpu_kernels.prefill_supported(heads, kv_heads, d):
        assert "paged_prefill" in calls
    monkeypatch.setattr("tokenos.layers.attention._use_c_kernel", lambda kv_cache: False)
    ref = run()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
