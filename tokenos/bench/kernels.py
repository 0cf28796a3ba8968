"""`tokenos bench kernels`: this machine's limits, then each hot kernel at the shapes that matter.

First the two limits every kernel is held against: copy bandwidth (a large tensor copied, read + write
bytes / time) and GEMM peak per dtype (a 2048-cube matmul). Then, on the embedded SmolLM2's shapes by
default (9 query heads, 3 KV heads of 64, hidden 576, MLP 1536, vocab 49152; override with flags):

- decode attention over the paged cache at batch x context, achieved GB/s of K/V read and % of copy
  bandwidth, the K/V streamed from memory (caches enough to overflow the last-level cache, in turn);
  the copy is measured again beside it, in turn with its calls, and its row gives that copy's GB/s
  (``copy_GB_s``), which its % is of;
- cascade decode attention (groups of requests sharing a cached prefix, as prefix-64's decode steps),
  with its data resident in cache (the kernel's arithmetic alone) and streamed from memory;
- prefill attention on chunks with and without a cached prefix, GFLOP/s and % of GEMM peak;
- each linear at M rows, dense (oneDNN-packed) and weight-only int8 / int4: GB/s of the weights as
  held, GFLOP/s (% of the limits);
- RMSNorm (+ residual), SiLU-and-mul, rotary: GB/s.

One JSON line per measurement (``--table`` prints a table instead). Times are the median of repeated
calls after warm-up; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from tokenos.platform import native_bf16_supported, torch_dtype


def timed(fn: Callable[[], object], min_time_s: float = 0.2, warmup: int = 3) -> float:
    """Median seconds of one call of ``fn`` (repeated until ``min_time_s`` has passed, at least 5x)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_time_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def call_each(fn: Callable[[object], object], items: list) -> None:
    """``fn(item)`` for every item, each result dropped before the next call, as a model's layers free
    their activations: holding every copy's output (12.6 MB for gate_up at 2048 rows, 19 copies) made the
    allocator fault in fresh pages on every call, and the timing measured that."""
    for item in items:
        fn(item)


def copy_bandwidth(nbytes: int = 1 << 28) -> float:
    """GB/s of a large copy (bytes read + bytes written)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src)) / 1e9


def timed_beside_copy(fn: Callable[[], object], rounds: int = 5) -> tuple[float, float]:
    """(median seconds of one call of ``fn``, median copy GB/s), the two measured in turn: a kernel bound
    by memory is compared with what the memory gave in the same minute. On a shared host the copy moved
    from 24 to 44 GB/s between minutes (a Zen 4 VM), so a copy measured once, minutes before, made the
    same kernel read as 55% or 89% of it."""
    seconds, bandwidths = [], []
    for _ in range(rounds):
        bandwidths.append(copy_bandwidth())
        seconds.append(timed(fn))
    return statistics.median(seconds), statistics.median(bandwidths)


def gemm_peak(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / timed(lambda: a @ b) / 1e9


# --kv-cache-dtype values with pages of their own dtype (others: the model's).
_BENCH_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def decode_attention(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    from tokenos.layers.attention import Attention, allocate_kv_cache
    from tokenos.layers.attention_metadata import build_attention_metadata

    block = args.block_size
    blocks_per_req = -(-context // block)
    kv_dtype = _BENCH_KV_DTYPES.get(args.kv_cache_dtype, dtype)
    kv_bytes = batch * context * 2 * args.kv_heads * args.head_dim * kv_dtype.itemsize
    # As a model's layers do, the calls walk caches that together overflow the last-level cache: one
    # cache of batch 64 x 576 tokens (28 MB) stayed in a Zen 4's 32 MB L3 and reported 28.1 GB/s, where
    # decode steps read their K/V from memory at 19-23 GB/s.
    caches = []
    for _ in range(llc_copies(kv_bytes)):
        cache = allocate_kv_cache(batch * blocks_per_req + 1, block, args.kv_heads, args.head_dim, kv_dtype)
        values = torch.randn(cache.shape)
        if kv_dtype == torch.int8:
            values = (values * 32).round().clamp(-127, 127)
        cache.view(torch.uint8).copy_(values.to(kv_dtype).view(torch.uint8))
        caches.append(cache)
    tables = [list(range(1 + r * blocks_per_req, 1 + (r + 1) * blocks_per_req)) for r in range(batch)]
    meta = build_attention_metadata(tables, [context - 1] * batch, [1] * batch, block)
    attn = Attention(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    # Scales as a calibrated int8 layer has them (the first timed call would otherwise calibrate).
    attn.fix_kv_scales(1 / 32, 1 / 32)
    q = torch.randn(batch, args.heads, args.head_dim).to(dtype)
    k = torch.randn(batch, args.kv_heads, args.head_dim).to(dtype)
    v = torch.randn_like(k)
    seconds, copy = timed_beside_copy(lambda: call_each(lambda c: attn.attend(q, k, v, c, meta), caches))
    seconds /= len(caches)
    return {"kernel": "decode_attention", "batch": batch, "context": context, "kv": str(kv_dtype)[6:],
            "us": seconds * 1e6, "GB_s": kv_bytes / seconds / 1e9, "copy_GB_s": copy}  # fmt: skip


def cascade_tables(groups: int, members: int, prefix: int, own: int, block: int) -> list[list[int]]:
    """Block tables of ``groups`` x ``members`` requests: each group's members share ``prefix`` tokens'
    pages (from page 1), and each request has pages of its own for ``own`` more tokens after them."""
    shared, mine = -(-prefix // block), -(-own // block)
    tables, next_page = [], 1 + groups * shared
    for g in range(groups):
        prefix_pages = list(range(1 + g * shared, 1 + (g + 1) * shared))
        for _ in range(members):
            tables.append(prefix_pages + list(range(next_page, next_page + mine)))
            next_page += mine
    return tables


def cascade_decode(own: int, resident: bool, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """Decode attention as prefix-64's decode steps have it: groups of requests sharing a cached prefix
    (--cascade-groups x --cascade-members, --cascade-prefix tokens), each with ``own`` tokens after it,
    with page epochs as the worker passes them (so a packed prefix is kept between calls), through the
    C kernel as the fused decode layer calls it (the module path's attend where the kernels are off).
    GB/s: the distinct K/V bytes (each prefix once, each request's own tokens) per call. resident: one
    layer's cache, called again and again, so all of it is in cache and the time is the kernel's
    arithmetic; else as many layers as overflow the last-level cache, called in turn, as a step reads
    them."""
    from dataclasses import replace

    from tokenos.layers import attention, cpu_kernels
    from tokenos.layers.attention import Attention, allocate_kv_cache
    from tokenos.layers.attention_metadata import build_attention_metadata

    groups, members, prefix = args.cascade_groups, args.cascade_members, args.cascade_prefix
    block = args.block_size
    tables = cascade_tables(groups, members, prefix, own, block)
    pages = 1 + max(max(t) for t in tables)
    row_bytes = 2 * args.kv_heads * args.head_dim * dtype.itemsize  # K and V of one token
    kv_bytes = (groups * prefix + groups * members * own) * row_bytes
    layers = 1 if resident else llc_copies(kv_bytes)
    caches = [
        allocate_kv_cache(pages, block, args.kv_heads, args.head_dim, dtype).normal_() for _ in range(layers)
    ]
    batch = groups * members
    meta = build_attention_metadata(tables, [prefix + own - 1] * batch, [1] * batch, block)
    meta = replace(meta, page_epochs=torch.arange(pages, dtype=torch.int64))
    scale = args.head_dim**-0.5
    q = torch.randn(batch, args.heads, args.head_dim)
    if attention._use_c_kernel(caches[0]):  # the module path's own test for the C decode kernel
        lens = meta.seq_lens.to(torch.int32)
        table = meta.block_table

        def call(cache: torch.Tensor) -> object:
            return cpu_kernels.paged_decode(q, cache, table, lens, scale, None, page_epochs=meta.page_epochs)
    else:
        attn = Attention(args.heads, args.kv_heads, args.head_dim, scale)
        k = torch.randn(batch, args.kv_heads, args.head_dim).to(dtype)
        qd, v = q.to(dtype), torch.randn_like(k)

        def call(cache: torch.Tensor) -> object:
            return attn.attend(qd, k, v, cache, meta)

    seconds = timed(lambda: call_each(call, caches)) / layers
    return {"kernel": "cascade_decode", "groups": groups, "members": members, "prefix": prefix, "own": own,
            "resident": resident, "us": seconds * 1e6, "GB_s": kv_bytes / seconds / 1e9}  # fmt: skip


def prefill_attention(chunk: int, prefix: int, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    from tokenos.layers.attention import Attention, allocate_kv_cache
    from tokenos.layers.attention_metadata import build_attention_metadata

    block = args.block_size
    total = prefix + chunk
    nblocks = -(-total // block)
    cache = allocate_kv_cache(nblocks + 1, block, args.kv_heads, args.head_dim, dtype)
    cache.normal_()
    meta = build_attention_metadata([list(range(1, nblocks + 1))], [prefix], [chunk], block)
    attn = Attention(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    q = torch.randn(chunk, args.heads, args.head_dim).to(dtype)
    k = torch.randn(chunk, args.kv_heads, args.head_dim).to(dtype)
    v = torch.randn_like(k)
    seconds = timed(lambda: attn.attend(q, k, v, cache, meta))
    # causal: each query attends to prefix + its position; QK^T and PV, 2 flops per MAC
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    flops = 4 * pairs * args.heads * args.head_dim
    return {"kernel": "prefill_attention", "chunk": chunk, "prefix": prefix, "us": seconds * 1e6,
            "GFLOP_s": flops / seconds / 1e9}  # fmt: skip


def linear(name: str, m: int, n: int, k: int, dtype: torch.dtype, weights: str = "dense") -> dict:
    """One linear as the model runs it (oneDNN-packed dense, or quantized "int8" / "int4"), over enough
    copies of the weight to overflow the last-level cache, so decode reads come from memory."""
    from tokenos.layers.linear import Linear

    dense_bytes = n * k * dtype.itemsize
    copies = llc_copies(dense_bytes)
    layers = []
    for _ in range(copies):
        layer = Linear(k, n)
        layer.weight.data = torch.randn(n, k).to(dtype)
        layer.pack(None if weights == "dense" else weights)
        layers.append(layer)
    x = torch.randn(m, k).to(dtype)
    seconds = timed(lambda: call_each(lambda layer: layer(x), layers)) / copies
    held = layers[0].quantized.nbytes if layers[0].quantized is not None else dense_bytes
    return {"kernel": f"linear_{name}", "weights": weights, "M": m, "N": n, "K": k, "us": seconds * 1e6,
            "GB_s": held / seconds / 1e9, "GFLOP_s": 2 * m * n * k / seconds / 1e9}  # fmt: skip


# Weights cycled through per measurement: more than a server CPU's last-level cache (in at most
# MAX_COPIES layers: the embedded model's smallest linear takes 58).
LLC_BYTES = 64 << 20
MAX_COPIES = 64


def llc_copies(nbytes: int) -> int:
    """How many copies of ``nbytes`` a measurement walks so that its reads come from memory."""
    return min(MAX_COPIES, max(1, -(-LLC_BYTES // nbytes)))


def elementwise(tokens: int, args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    from tokenos.layers.activation import SiluAndMul
    from tokenos.layers.layernorm import RMSNorm
    from tokenos.layers.rotary import RotaryEmbedding

    hidden, inter = args.hidden, args.intermediate
    norm = RMSNorm(hidden)
    norm.weight.data = torch.ones(hidden, dtype=dtype)
    x, res = torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)
    gate_up = torch.randn(tokens, 2 * inter).to(dtype)
    rope = RotaryEmbedding(args.head_dim, 4096, 10000.0, None)
    pos = torch.randint(0, 4096, (tokens,))
    q = torch.randn(tokens, args.heads, args.head_dim).to(dtype)
    kk = torch.randn(tokens, args.kv_heads, args.head_dim).to(dtype)
    e = dtype.itemsize
    rows = []
    for name, fn, nbytes in (
        ("rmsnorm_residual", lambda: norm(x, res), 4 * tokens * hidden * e),
        ("silu_and_mul", lambda: SiluAndMul()(gate_up), 3 * tokens * inter * e),
        ("rotary", lambda: rope(rope.cos_sin(pos, dtype), q, kk), 2 * (q.numel() + kk.numel()) * e),
    ):
        seconds = timed(fn)
        rows.append({"kernel": name, "tokens": tokens, "us": seconds * 1e6, "GB_s": nbytes / seconds / 1e9})
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto", help="decode attention pages: auto, fp8 or int8")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 2048])
    parser.add_argument("--cascade-groups", type=int, default=8, help="cascade: groups sharing a prefix")
    parser.add_argument("--cascade-members", type=int, default=8, help="cascade: requests per group")
    parser.add_argument("--cascade-prefix", type=int, default=512, help="cascade: shared tokens")
    parser.add_argument(
        "--cascade-own", type=int, nargs="+", default=[1, 96], help="cascade: tokens of each request's own"
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["dense", "int8", "int4"],
        help="linears: dense (oneDNN-packed) and/or quantized int8 / int4 (weight-only)",
    )
    parser.add_argument(
        "--sections", nargs="+", default=["limits", "decode", "cascade", "prefill", "linear", "elementwise"]
    )
    parser.add_argument("--table", action="store_true", help="a table instead of JSON lines")
    parser.add_argument("--max-kv-gib", type=float, default=4.0, help="skip decode shapes needing more")


def run(args: argparse.Namespace) -> list[dict]:
    dtype = torch.bfloat16 if args.dtype == "auto" and native_bf16_supported() else None
    dtype = dtype or (torch.float32 if args.dtype == "auto" else torch_dtype(args.dtype))
    rows: list[dict] = []
    bandwidth = peak = None
    if "limits" in args.sections:
        bandwidth = copy_bandwidth()
        peak = gemm_peak(dtype)
        rows += [
            {"kernel": "copy", "GB_s": bandwidth},
            {"kernel": "gemm_2048", "GFLOP_s": peak},
        ]
    if "decode" in args.sections:
        for batch in args.batches:
            for context in args.contexts:
                kv = batch * context * 2 * args.kv_heads * args.head_dim * dtype.itemsize
                if kv > args.max_kv_gib * (1 << 30):
                    continue
                rows.append(decode_attention(batch, context, args, dtype))
    if "cascade" in args.sections:
        for own in args.cascade_own:
            for resident in (True, False):
                rows.append(cascade_decode(own, resident, args, dtype))
    if "prefill" in args.sections:
        for chunk, prefix in ((512, 0), (512, 1536), (2048, 0), (2048, 2048)):
            rows.append(prefill_attention(chunk, prefix, args, dtype))
    if "linear" in args.sections:
        shapes = {
            "qkv": (args.heads * args.head_dim + 2 * args.kv_heads * args.head_dim, args.hidden),
            "o": (args.hidden, args.heads * args.head_dim),
            "gate_up": (2 * args.intermediate, args.hidden),
            "down": (args.hidden, args.intermediate),
            "lm_head": (args.vocab, args.hidden),
        }
        for m in args.rows:
            for name, (n, k) in shapes.items():
                for weights in args.weights:
                    rows.append(linear(name, m, n, k, dtype, weights))
    if "elementwise" in args.sections:
        for tokens in (64, 2048):
            rows += elementwise(tokens, args, dtype)
    for row in rows:
        row.setdefault("dtype", str(dtype).removeprefix("torch."))
        # Against the copy measured beside the kernel where it was (decode attention), else the limits'.
        limit = row.get("copy_GB_s", bandwidth)
        if limit and "GB_s" in row and row["kernel"] != "copy":
            row["pct_bandwidth"] = 100 * row["GB_s"] / limit
        if peak and "GFLOP_s" in row and row["kernel"] != "gemm_2048":
            row["pct_peak"] = 100 * row["GFLOP_s"] / peak
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = round(value, 2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenos bench kernels", description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for row in run(args):
        if args.table:
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        else:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
