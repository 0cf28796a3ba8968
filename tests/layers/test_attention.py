"""Paged attention vs a dense float64 reference: mixed decodes and chunks, windows, padded pages."""

from __future__ import annotations

import random

import pytest
import torch

from tokenos.layers.attention import Attention, allocate_kv_cache
from tokenos.layers.attention_metadata import build_attention_metadata

H, KVH, D = 4, 2, 8


def reference(q, k, v, q_pos, window):
    """q [n, H, D] at positions q_pos; k/v [L, KVH, D] for positions 0..L-1."""
    k = k.double().repeat_interleave(H // KVH, dim=1)
    v = v.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(attn, cache, block_size, steps, history, rng):
    """Run each step ({req: num_new}); return per-step outputs and the full per-request K/V/q."""
    blocks: dict[int, list[int]] = {}
    free = list(range(1, cache.shape[0]))
    rng.shuffle(free)
    outputs = []
    for step in steps:
        reqs = list(step)
        for r in reqs:
            need = -(-(len(history[r]["k"]) + step[r]) // block_size)
            blocks.setdefault(r, [])
            while len(blocks[r]) < need:
                blocks[r].append(free.pop())
        computed = [len(history[r]["k"]) for r in reqs]
        meta = build_attention_metadata(
            [blocks[r] for r in reqs], computed, [step[r] for r in reqs], block_size
        )
        q, k, v = (torch.randn(meta.num_actual_tokens, n, D) for n in (H, KVH, KVH))
        out = attn.attend(q, k, v, cache, meta).view(-1, H, D)
        for i, r in enumerate(reqs):
            s, e = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
            for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
                history[r][name] = torch.cat((history[r].get(name, torch.empty(0, t.shape[1], D)), t[s:e]))
        outputs.append(meta)
    return outputs


@pytest.fixture(params=["c-kernel", "torch"])
def decode_path(request, monkeypatch):
    """Run each test through the C decode kernel and through the pure-torch fallback."""
    import tokenos.layers.attention as attention
    from tokenos.layers import cpu_kernels

    if request.param == "c-kernel":
        if cpu_kernels.load() is None:
            pytest.skip("no C compiler: the C decode kernel could not be built")
    else:
        monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: False)
    return request.param


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("padded_pages", [False, True])
def test_paged_attention_matches_dense(window, padded_pages, decode_path, monkeypatch):

    torch.manual_seed(0)
    rng = random.Random(0)
    block_size, num_blocks = 4, 80
    cache = allocate_kv_cache(num_blocks, block_size, KVH, D, torch.float32)
    if padded_pages:  # hybrid-style pages: each block followed by unused rows
        pages = torch.zeros(num_blocks, 2 * block_size + 3, KVH, D)
        cache = pages[:, : 2 * block_size].view(num_blocks, 2, block_size, KVH, D)
    attn = Attention(H, KVH, D, D**-0.5, sliding_window=window)
    history = {r: {"k": torch.empty(0, KVH, D)} for r in range(5)}
    steps = [
        {0: 3, 1: 17, 2: 1, 3: 30, 4: 9},  # fresh prefills, one single-token prompt
        {1: 1, 0: 5, 3: 1, 2: 1, 4: 1},  # decodes of very different lengths + a chunk after a prefix
        {4: 7, 3: 1, 0: 1, 1: 2, 2: 1},
        {2: 1, 3: 1, 1: 1, 4: 1, 0: 1},
    ]
    metas = run_steps(attn, cache, block_size, steps, history, rng)
    assert len(metas[3].decode_groups) > 1  # lengths 4..33 split into several decode groups (torch path)
    for h in history.values():
        positions = torch.arange(len(h["k"]))
        expected = reference(h["q"], h["k"], h["v"], positions, window)
        torch.testing.assert_close(h["out"].double(), expected, atol=1e-5, rtol=1e-5)


def test_build_attention_metadata_slots_and_lengths():
    meta = build_attention_metadata([[5, 2], [7], [3, 9, 4]], [6, 0, 9], [1, 3, 2], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == [7, 3, 11] and meta.seq_lens_list == [7, 3, 11]
    assert meta.query_lens_list == [1, 3, 2] and meta.num_actual_tokens == 6
    # req0 pos 6 -> block 2 offset 2; req1 pos 0..2 -> block 7; req2 pos 9,10 -> block 4 offsets 1,2
    assert meta.slot_mapping.tolist() == [10, 28, 29, 30, 17, 18]
    assert meta.block_table.dtype == torch.int32 and meta.block_table.tolist()[1] == [7, 0, 0]
    assert [p.req_index for p in meta.prefills] == [1, 2] and meta.prefills[0].slots is None
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([[1]], [4], [1], block_size=4)


def test_c_kernel_matches_torch_path_in_bfloat16(monkeypatch):
    """The C kernel reads bf16 pages itself; it must agree with the torch gather + SDPA path."""
    import tokenos.layers.attention as attention
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    torch.manual_seed(1)
    block_size = 16
    cache = torch.randn(40, 2, block_size, KVH, D).to(torch.bfloat16)
    lens = [1, 17, 64, 100]
    tables = [list(range(1 + 7 * i, 1 + 7 * i + -(-n // block_size))) for i, n in enumerate(lens)]
    meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
    q = torch.randn(len(lens), H, D).to(torch.bfloat16)
    k, v = (torch.randn(len(lens), KVH, D).to(torch.bfloat16) for _ in range(2))
    attn = Attention(H, KVH, D, D**-0.5, sliding_window=40)
    fast = attn.attend(q, k, v, cache.clone(), meta).float()
    monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: False)
    fresh_meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
    slow = attn.attend(q, k, v, cache.clone(), fresh_meta)
    torch.testing.assert_close(fast, slow.float(), atol=2e-2, rtol=2e-2)


def decode_tables(lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables for decodes of these context lengths, each request's pages in reverse order (pages
    in any order), and the pool size they need (page 0 is the null page)."""
    tables, first = [], 1
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(first, first + count))[::-1])
        first += count
    return tables, first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "block_size", "window"),
    [
        (9, 3, 64, 16, None),
        (9, 3, 64, 16, 300),
        (12, 4, 32, 8, None),
        (8, 8, 16, 32, 129),
        (64, 16, 16, 16, None),
        (128, 32, 16, 16, 200),
    ],
)
def test_c_kernel_matches_torch_path_at_large_batches(
    dtype, heads, kv_heads, head_size, block_size, window, monkeypatch
):
    """Large batches (one work item per request, each over several score chunks, of 256 tokens or
    fewer as heads grow), random context lengths (partial chunks and tiles, odd lengths), windows
    that start inside a page and span chunks: the C kernel against the torch path."""
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    rng = random.Random(heads * 1000 + block_size + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    lens = [rng.randint(1, 700) for _ in range(40)] + [255, 256, 257, 513]
    _check_c_kernel_against_torch(monkeypatch, lens, block_size, heads, kv_heads, head_size, window, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [
        (4, 2, 8),
        (4, 2, 16),
        (9, 3, 64),
        (8, 2, 32),
        (4, 4, 16),
        (8, 1, 128),
        (6, 3, 48),
        (2, 1, 256),
        # Groups of 5 and 7: the AVX2 item takes query heads 4 at a time, so 4 + 1 and 4 + 3.
        (10, 2, 32),
        (7, 1, 64),
    ],
)
@pytest.mark.parametrize("window", [None, 37])
def test_c_kernel_matches_torch_path_over_shapes(dtype, heads, kv_heads, head_size, window, monkeypatch):
    """Every path of the C kernel (vector tiles for each GQA group and head size, the generic loop,
    splits of long contexts merged by log-sum-exp, windows, partial last tiles) against the torch path."""
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    torch.manual_seed(head_size + heads)
    lens = [1, 5, 16, 17, 300, 1100]
    _check_c_kernel_against_torch(monkeypatch, lens, 16, heads, kv_heads, head_size, window, dtype)


def _check_c_kernel_against_torch(monkeypatch, lens, block_size, heads, kv_heads, head_size, window, dtype):
    """One decode token per request of context ``lens``: the C kernel against the float32 torch path."""
    import tokenos.layers.attention as attention

    tables, first = decode_tables(lens, block_size)
    cache = torch.randn(first, 2, block_size, kv_heads, head_size).to(dtype)
    q = torch.randn(len(lens), heads, head_size).to(dtype)
    k, v = (torch.randn(len(lens), kv_heads, head_size).to(dtype) for _ in range(2))
    attn = Attention(heads, kv_heads, head_size, head_size**-0.5, sliding_window=window)

    def run(c_kernel: bool) -> torch.Tensor:
        # The kernel reads the cache in `dtype` and widens it exactly; the reference is the float32
        # torch path over the same (rounded) values, so both compute the same float32 math.
        monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
        meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
        pages = cache.clone() if c_kernel else cache.float()
        new_k, new_v = (t if c_kernel else t.float() for t in (k, v))
        return attn.attend(q.float(), new_k, new_v, pages, meta).float()

    fast, ref = run(True), run(False)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-4)
        return
    # bf16 pages: with AVX512-BF16 the kernel rounds the probabilities to bf16 for P V (as torch's
    # bf16 attention does), a relative error of 2^-9 per weight; elsewhere it is float32 throughout.
    torch.testing.assert_close(fast, ref, atol=8e-3, rtol=1e-2)
    assert (fast - ref).abs().mean() < 1e-3


def shared_tables(groups: list[tuple[int, list[int]]], block_size: int, rng: random.Random):
    """Decodes in groups sharing leading pages, members interleaved across the batch: each group is
    (pages its members share, the members' context lengths); a member's own pages follow the shared
    ones. Returns (lens, tables, pool size)."""
    first, rows = 1, []
    for shared, lens in groups:
        common = list(range(first, first + shared))[::-1]
        first += shared
        for n in lens:
            own = max(0, -(-n // block_size) - shared)
            rows.append((n, common[: -(-n // block_size)] + list(range(first, first + own))))
            first += own
    rng.shuffle(rows)
    return [n for n, _ in rows], [t for _, t in rows], first


_RNG_LENS = random.Random(7)
CASCADE_GROUPS = {
    "many": [
        (32, [520, 530, 600, 513, 700]),
        (10, [170, 161, 200]),
        (3, [60, 70]),  # 48 shared tokens: too few for a group
        (40, [_RNG_LENS.randint(641, 900) for _ in range(20)]),
        (8, [129, 300]),
        (20, [100, 330, 400]),  # the first member's context ends inside the shared pages
        (0, [50, 600, 1]),
    ],
    # One group of 9 (a request's decode and 8 drafts): fewer items than threads' worth, so the
    # members are spread over more items (27 rows as 15 + 12: no more row blocks).
    "one": [(18, [300 + i for i in range(9)])],
    # One group of 5 (a decode and 4 drafts): 15 rows, one row block whatever the spread, so the shared
    # keys are cut into pieces instead, each a partial merged with the rest.
    "one-cut": [(18, [300 + i for i in range(5)])],
    # Two groups of 2 (n = 2 samples of two prompts) and a single request.
    "pairs": [(9, [150, 160]), (12, [200, 205]), (0, [90])],
}


@pytest.mark.parametrize("pages", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASCADE_GROUPS))
def test_c_kernel_cascade_over_shared_pages_matches_torch_path(monkeypatch, case, pages):
    """Decodes whose block tables share leading pages (a system prompt's, n samples'): the kernel attends
    the common pages once per group (cascade) and merges with each request's own tokens. Groups of 2 to
    20, members sharing different numbers of pages (the group takes what all share), members whose
    context ends inside the shared pages, a group sharing too little to be one, single requests; small
    groups alone, spread over items or cut into key pieces; against the float32 torch path and against
    the kernel with cascade off. bf16 and float32 pages (AVX2 cascades both; AVX512-BF16 bf16 ones)."""
    import tokenos.layers.attention as attention
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    rng = random.Random(7)
    torch.manual_seed(7)
    block_size = 16
    lens, tables, pool = shared_tables(CASCADE_GROUPS[case], block_size, rng)
    heads, kv_heads, d = 9, 3, 64
    cache = torch.randn(pool, 2, block_size, kv_heads, d).to(pages)
    groups = []
    q = torch.randn(len(lens), heads, d)
    k, v = (torch.randn(len(lens), kv_heads, d).to(pages) for _ in range(2))
    attn = Attention(heads, kv_heads, d, d**-0.5)

    def run(c_kernel: bool, cascade: bool = True) -> torch.Tensor:
        monkeypatch.setattr(attention, "_use_c_kernel", lambda kv_cache: c_kernel)
        cpu_kernels.set_cascade(cascade)
        try:
            meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size)
            kv = cache.clone() if c_kernel else cache.float()
            new_k, new_v = (t if c_kernel else t.float() for t in (k, v))
            out = attn.attend(q, new_k, new_v, kv, meta).float()
            groups.append(cpu_kernels.cascaded_groups())
            return out
        finally:
            cpu_kernels.set_cascade(True)

    fast, plain, ref = run(True), run(True, cascade=False), run(False)
    assert (groups[0] > 0) == cpu_kernels.uses_cascade(pages) and groups[1] == 0
    torch.testing.assert_close(fast, ref, atol=8e-3, rtol=1e-2)
    assert (fast - ref).abs().mean() < 1e-3
    # The shared pages' partials come from the tiled kernel, so only the fp32 summation order differs.
    torch.testing.assert_close(fast, plain, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("pages", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize(("softcap", "with_sinks"), [(None, True), (30.0, False), (20.0, True)])
def test_c_kernel_cascade_keeps_soft_cap_and_sinks(softcap, with_sinks, pages):
    """Gemma 2's soft cap bends the shared pages' scores too, and a sink joins each head's sum once,
    after the group's partial and the request's own are merged; over every page dtype the kernel reads
    (AVX2 cascades them all, with a K / V scale folded in for the 8-bit ones)."""
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the C decode kernel could not be built")
    rng = random.Random(3)
    torch.manual_seed(3)
    lens, tables, pool = shared_tables([(12, [200, 250, 197, 300]), (6, [120, 99])], 16, rng)
    heads, kv_heads, d = 8, 2, 64
    if pages == torch.int8:
        cache = torch.randint(-127, 128, (pool, 2, 16, kv_heads, d), dtype=torch.int8)
    else:
        cache = torch.randn(pool, 2, 16, kv_heads, d).to(pages)
    scales = (0.02, 0.03) if pages == torch.int8 else (1.0, 1.0)
    q = torch.randn(len(lens), heads, d) * 3
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    sinks = torch.randn(heads) if with_sinks else None
    outs, groups = [], []
    for cascade in (True, False):
        cpu_kernels.set_cascade(cascade)
        try:
            outs.append(
                cpu_kernels.paged_decode(
                    q, cache, table, seq, d**-0.5, None, *scales, softcap=softcap, sinks=sinks
                )
            )
            groups.append(cpu_kernels.cascaded_groups())
        finally:
            cpu_kernels.set_cascade(True)
    assert groups == [2 if cpu_kernels.uses_cascade(pages) else 0, 0]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)


def test_c_kernel_cascade_keeps_packed_prefixes_while_their_pages_keep_their_epochs():
    """With page epochs, a decode group's packed prefix is kept between calls: a second call finds it
    (and gives the same output), a page whose epoch moved is packed again from its new content, pages
    rewritten without a new epoch are (by the contract) still served from the packed copy, and a new
    pool's epochs never match an old pool's entries. Bounded: limit 0 keeps nothing."""
    from tokenos.layers import cpu_kernels
    from tokenos.worker.kv_cache import PageEpochs

    if cpu_kernels.load() is None or not (cpu_kernels.uses_cascade() and cpu_kernels.packs_prefixes()):
        pytest.skip("cascade attention needs the AVX512-BF16 kernels")
    rng = random.Random(5)
    torch.manual_seed(5)
    block_size, heads, kv_heads, d = 16, 9, 3, 64
    lens, tables, pool = shared_tables([(12, [200, 250, 197, 300]), (8, [150, 160, 170])], block_size, rng)
    cache = torch.randn(pool, 2, block_size, kv_heads, d).to(torch.bfloat16)
    q = torch.randn(len(lens), heads, d)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    shared = sorted({b for t in tables for b in t if sum(b in u for u in tables) > 1})

    def decode(epochs: PageEpochs | None) -> torch.Tensor:
        pages = None if epochs is None else epochs.epochs
        return cpu_kernels.paged_decode(q, cache, table, seq, d**-0.5, None, page_epochs=pages)

    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()
    try:
        epochs = PageEpochs(pool)
        first = decode(epochs)
        assert cpu_kernels.cascade_cache_stats()["misses"] == 2
        torch.testing.assert_close(first, decode(None), atol=0, rtol=0)
        assert torch.equal(decode(epochs), first)
        assert cpu_kernels.cascade_cache_stats()["hits"] == 2
        # New content in one shared page, its epoch moved: packed again, as a fresh kernel sees it.
        cache[shared[0]] = torch.randn(2, block_size, kv_heads, d).to(torch.bfloat16)
        epochs.bump([shared[0]])
        moved = decode(epochs)
        torch.testing.assert_close(moved, decode(None), atol=0, rtol=0)
        assert not torch.equal(moved, first)
        # Rewritten without a new epoch: the packed copy answers (what the epoch contract is for).
        cache[shared[0]] = torch.randn(2, block_size, kv_heads, d).to(torch.bfloat16)
        assert torch.equal(decode(epochs), moved)
        # Another pool's epochs are fresh values: nothing of the old pool matches.
        before = cpu_kernels.cascade_cache_stats()["misses"]
        torch.testing.assert_close(decode(PageEpochs(pool)), decode(None), atol=0, rtol=0)
        assert cpu_kernels.cascade_cache_stats()["misses"] == before + 2
        cpu_kernels.set_cascade_cache_limit(0)
        assert cpu_kernels.cascade_cache_stats()["entries"] == 0
        decode(epochs)
        assert cpu_kernels.cascade_cache_stats()["entries"] == 0
    finally:
        cpu_kernels.set_cascade_cache_limit(None)
        cpu_kernels.clear_cascade_cache()


def test_c_kernel_cascade_drops_entries_whose_first_page_moved():
    """Requests one at a time (a speculative verify's rows are a group) leave their entries behind: when
    the next request starts on the same first page (a cached prompt prefix) handed out again with a new
    epoch, the old entry can never match and goes at that lookup, rather than keeping its memory until
    it turns stale; another cache's entries wait for a lookup over theirs."""
    from tokenos.layers import cpu_kernels
    from tokenos.worker.kv_cache import PageEpochs

    if cpu_kernels.load() is None or not (cpu_kernels.uses_cascade() and cpu_kernels.packs_prefixes()):
        pytest.skip("cascade attention needs the AVX512-BF16 kernels")
    torch.manual_seed(13)
    block_size, heads, kv_heads, d, rows, pages = 16, 8, 2, 64, 5, 20
    caches = [torch.randn(2 * pages + 1, 2, block_size, kv_heads, d).to(torch.bfloat16) for _ in range(2)]
    q = torch.randn(rows, heads, d)
    seq = torch.arange(200, 200 + rows, dtype=torch.int32)
    epochs = PageEpochs(2 * pages + 1)
    first = list(range(1, pages + 1))
    second = [1, *range(pages + 1, 2 * pages)]  # page 1 again, then pages of its own

    def decode(cache: torch.Tensor, blocks: list[int]) -> None:
        table = torch.tensor([blocks] * rows, dtype=torch.int32)
        got = cpu_kernels.paged_decode(q, cache, table, seq, d**-0.5, None, page_epochs=epochs.epochs)
        torch.testing.assert_close(
            got, cpu_kernels.paged_decode(q, cache, table, seq, d**-0.5, None), atol=0, rtol=0
        )

    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()
    try:
        decode(caches[0], first)
        decode(caches[1], first)
        assert cpu_kernels.cascade_cache_stats()["entries"] == 2
        epochs.bump(second)  # the next request's pages, page 1 among them
        decode(caches[0], second)
        stats = cpu_kernels.cascade_cache_stats()
        assert (stats["entries"], stats["misses"]) == (2, 3)  # cache 0's old entry went; cache 1's stays
        decode(caches[1], second)
        assert cpu_kernels.cascade_cache_stats()["entries"] == 2
    finally:
        cpu_kernels.clear_cascade_cache()


def test_c_kernel_cascade_grows_a_packed_prefix_in_place():
    """A speculative verify's rows of one request are a group whose shared pages grow a page at a time:
    the entry packs only the new tiles (from its whole ones), and a shorter group later is served by the
    longer entry; both exactly as a fresh pack."""
    from tokenos.layers import cpu_kernels
    from tokenos.worker.kv_cache import PageEpochs

    if cpu_kernels.load() is None or not (cpu_kernels.uses_cascade() and cpu_kernels.packs_prefixes()):
        pytest.skip("cascade attention needs the AVX512-BF16 kernels")
    torch.manual_seed(11)
    block_size, heads, kv_heads, d, rows, pages = 16, 8, 2, 64, 5, 40
    cache = torch.randn(pages + 1, 2, block_size, kv_heads, d).to(torch.bfloat16)
    table = torch.arange(1, pages + 1, dtype=torch.int32).repeat(rows, 1).contiguous()
    q = torch.randn(rows, heads, d)
    epochs = PageEpochs(pages + 1)

    def decode(context: int, with_epochs: bool = True) -> torch.Tensor:
        seq = torch.arange(context + 1, context + rows + 1, dtype=torch.int32)
        pe = epochs.epochs if with_epochs else None
        return cpu_kernels.paged_decode(q, cache, table, seq, d**-0.5, None, page_epochs=pe)

    cpu_kernels.set_cascade_cache_limit(None)
    cpu_kernels.clear_cascade_cache()
    try:
        # 12, 13, 14, 18 shared pages (room for 11 tiles, so 36 pages move the entry to a larger buffer)
        for context in (200, 216, 232, 300, 580):
            torch.testing.assert_close(decode(context), decode(context, False), atol=0, rtol=0)
        stats = cpu_kernels.cascade_cache_stats()
        assert (stats["misses"], stats["grown"], stats["entries"]) == (1, 4, 1)
        torch.testing.assert_close(decode(120), decode(120, False), atol=0, rtol=0)
        assert cpu_kernels.cascade_cache_stats()["hits"] == 1
    finally:
        cpu_kernels.clear_cascade_cache()
