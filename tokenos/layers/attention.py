"""Paged attention on CPU with torch: write this step's K/V into cache slots, then attend.

Cache layout per layer: ``kv_cache[num_blocks, 2, block_size, num_kv_heads, head_size]``
(block outermost; index 0 = K, 1 = V). Block 0 is the null block: padding reads it, nothing
real lives there. Viewed flat as rows of ``[num_kv_heads, head_size]``, token ``offset`` of
block ``b`` has its K at row ``b * rows_per_block + offset`` and its V ``block_size`` rows
later; ``rows_per_block`` is ``2 * block_size`` unless pages are padded (hybrid models).

`Attention` is a cache layer (see `tokenos.layers.metadata`): each step it takes its page tensor and
its group's `AttentionMetadata` from the `ForwardBatch`, does one ``index_copy_`` (write), then the
decodes (the C kernel reading pages in place, or one gather plus one masked SDPA per group of decodes,
GQA folded into the query-length axis) and one tiled attention per prefill chunk. Masked cache rows are
multiplied by zero probabilities, so caches must hold finite values: allocate them zeroed.

FP8 pages (``--kv-cache-dtype fp8``, float8 e4m3fn) store ``K / k_scale`` and ``V / v_scale``, clamped to
the e4m3 range (+-448) before conversion so an outlier saturates instead of depending on how a torch
version converts out-of-range values (NaN in some). One scale per tensor per layer, 1.0 by default
(vLLM's calibration-free default). The C decode kernel reads the bytes in place; the torch paths
gather and convert to the query's dtype; the C prefill kernel widens them to bf16 as it packs K/V.

INT8 pages (``--kv-cache-dtype int8``) store ``round(K / k_scale)`` clamped to [-127, 127] (symmetric, no
zero point), read exactly like fp8 pages (widened, times the scale). A scale of 1.0 would round K to
integers, so int8 layers always calibrate, as vLLM's ``--calculate-kv-scales`` does (which fp8 layers
follow when ``calculate_kv_scales`` is set): the first forward that writes real tokens (any slot
outside the null block) fixes ``k_scale`` and ``v_scale`` from its K and V before they are written,
and they never change after, since every page of the layer is read with them. int8 takes
``KV_HEADROOM * amax / 127``: the first batch's largest value lands at 127 / KV_HEADROOM, so later
values up to KV_HEADROOM times larger still fit (the rest clip); fp8 takes vLLM's ``amax / 200`` for
K and ``amax / 100`` for V (K_SCALE_CONSTANT, V_SCALE_CONSTANT: 2.2x and 4.5x headroom under 448).

Attention-logit soft-capping (Gemma 2's ``attn_logit_softcapping``: ``tanh(s / cap) * cap`` on the scaled
scores, before the mask) and attention sinks (gpt-oss's per-head ``sinks``: one learned logit per query head
joins every row's softmax denominator as an extra key with no value, so a row's probabilities sum to less
than 1) are taken by both C kernels: the decode kernel caps each score and folds the sinks into its final
normalisation (after merging its splits), the prefill kernel caps each tile's scores and folds the sinks
where it normalizes a row. SDPA takes neither, so where the C kernels do not run, a layer with either runs
its decodes and prefills through one explicit float32 attention over the same gathered pages
(`softcap_attention`, also the kernels' reference in the tests).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenos.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from tokenos.layers import cpu_kernels
from tokenos.layers.attention_metadata import AttentionMetadata, PrefillChunk
from tokenos.layers.metadata import CacheLayer, ForwardBatch
from tokenos.platform import is_fp8, is_scaled_kv, kv_cache_dtype_name, native_bf16_supported

if TYPE_CHECKING:
    from tokenos.config import CacheConfig


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """A zeroed cache (zeros, not empty: masked padding rows must be finite)."""
    return torch.zeros(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype)


def page_rows(cache: torch.Tensor, row_ndim: int) -> tuple[torch.Tensor, int]:
    """Pages ``[num_blocks, *rows of a page, *row]`` (the last ``row_ndim`` dims one row) as rows
    ``[*, *row]``, and how many rows apart blocks start.

    Blocks may sit further apart than their own rows when a hybrid model pads its pages; the padding
    rows are then part of the flat view but never addressed.
    """
    row_shape = cache.shape[cache.dim() - row_ndim :]
    row = math.prod(row_shape)
    if cache.is_contiguous():
        return cache.view(-1, *row_shape), cache[0].numel() // row
    packed = torch.empty(cache.shape[1:], device="meta").stride()  # a page's own rows, back to back
    if cache.stride()[1:] != packed or cache.stride(0) % row:
        raise ValueError(f"KV cache strides {cache.stride()} are not block-outermost pages of whole rows")
    rows_per_block = cache.stride(0) // row
    flat = cache.as_strided((cache.shape[0] * rows_per_block, *row_shape), (row, *packed[-row_ndim:]))
    return flat, rows_per_block


def flat_cache_view(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` as rows [*, num_kv_heads,
    head_size], and how many rows apart blocks start (`page_rows`)."""
    return page_rows(kv_cache, 2)


FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8 e4m3fn, saturating at +-448 (clamped first: conversion of out-of-range
    values is not saturating in every torch version)."""
    if scale != 1.0:
        x = x / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


INT8_MAX = 127.0  # symmetric int8: -128 is never stored, so K and -K round to the same magnitude
# int8 scale = KV_HEADROOM * amax / 127 of the calibrating batch. 2: one bit of resolution spent so that
# later K / V up to twice the calibration batch's largest still fit (vLLM's fp8 constants leave 2.2x
# for K and 4.5x for V under e4m3's 448, where headroom costs fp8 no relative precision).
KV_HEADROOM = 2.0
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: fp8 scale = amax / constant under --calculate-kv-scales.
FP8_K_SCALE_CONSTANT = 200.0
FP8_V_SCALE_CONSTANT = 100.0


def quantize_int8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """round(x / scale) as int8 (half to even), saturating at +-127, NaN as 0; x times the float32
    reciprocal of the scale, bit for bit as the C write (`cpu_kernels.kv_write_8bit`) computes it."""
    q = x.float() * (1.0 / scale)
    return q.round_().clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0).to(torch.int8)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the values of scaled pages of ``dtype`` (float8 e4m3fn or int8)."""
    return quantize_fp8(x, scale) if is_fp8(dtype) else quantize_int8(x, scale)


def _amax(x: torch.Tensor) -> float:
    """The largest finite |x| (0.0 if none): one inf or NaN must not make the scale useless."""
    a = x.detach().float().abs()
    a = a[torch.isfinite(a)]
    return float(a.max()) if a.numel() else 0.0


def calibrated_scale(amax: float, dtype: torch.dtype, constant: float) -> float:
    """The per-tensor scale of pages of ``dtype`` for values up to ``amax`` (see the module notes);
    ``constant``: vLLM's fp8 divisor."""
    return amax / constant if is_fp8(dtype) else KV_HEADROOM * amax / INT8_MAX


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache values as ``dtype``: fp8 / int8 pages widened and times their scale, others converted."""
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x


def _use_c_kernel(kv_cache: torch.Tensor) -> bool:
    """The C decode kernel reads pages in place: it needs whole-row pages and a built library."""
    if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        return False
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    row = num_kv_heads * head_size
    if kv_cache.stride()[1:] != (block_size * row, row, head_size, 1):
        return False
    return head_size <= cpu_kernels.MAX_HEAD_SIZE and cpu_kernels.load() is not None


def _use_c_kv_write(k: torch.Tensor, v: torch.Tensor) -> bool:
    """The C 8-bit page write takes float32 / bf16 K and V whose rows ([KVH, D]) are contiguous."""
    return cpu_kernels.usable(k, v) and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]


def softcap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit attention with soft-capped scores, as transformers' eager Gemma 2 attention: q [B, H, Lq, D],
    k / v [B, KVH, Lk, D] (KVH divides H), ``mask`` bool broadcastable to [B, H, Lq, Lk] (None: causal,
    aligned to the end of the keys). ``cap`` None: no cap. ``sinks`` (broadcastable to [B, H, Lq, 1]): a
    logit per row appended to the softmax and dropped after it, as transformers' eager gpt-oss attention.
    Scores, cap, mask and softmax in float32; returns float32."""
    q, k, v = q.float(), k.float(), v.float()
    if k.shape[1] != q.shape[1]:  # GQA: each KV head serves H / KVH query heads (transformers' repeat_kv)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is None:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


class Attention(CacheLayer):
    """Paged multi-head attention with GQA, an optional sliding window (in tokens), an optional
    attention-logit soft cap and optional attention sinks (``sinks`` [num_heads], owned and loaded by the
    model's attention module). The C kernels take both; where they do not run (no library, float32 prefill,
    a CPU without AVX512-BF16), either keeps the layer on the explicit torch path, `softcap_attention`."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.logit_softcap = logit_softcap
        # The parent registers the same Parameter first, so it loads under the parent's (checkpoint) name.
        self.sinks = sinks
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        # Per-tensor scales of fp8 / int8 pages (stored value = K / k_scale); unused by other dtypes.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # vLLM's calculate_kv_scales for fp8 pages (the model runner sets it from the CacheConfig); int8
        # pages calibrate whatever it says.
        self.calculate_kv_scales = False
        self._open_scales = {"k", "v"}  # those no real value has fixed yet

    @property
    def kv_scales_calibrated(self) -> bool:
        """Whether k_scale and v_scale are fixed (no later forward changes them)."""
        return not self._open_scales

    def kv_scales_settled(self, dtype: torch.dtype) -> bool:
        """Whether no later forward changes k_scale / v_scale for pages of ``dtype``: calibrated, or never
        to be (fp8 pages without calculate_kv_scales keep 1.0)."""
        return self.kv_scales_calibrated or not (self.calculate_kv_scales or dtype == torch.int8)

    def fix_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Fix the scales by hand, as a calibrated layer holds them (a benchmark timing such a layer)."""
        self.k_scale, self.v_scale = k_scale, v_scale
        self._open_scales.clear()

    def get_kv_cache_spec(self, cache_config: CacheConfig, dtype: str) -> FullAttentionSpec:
        """Pages in ``cache_config.cache_dtype`` (``dtype``, the model's, when "auto")."""
        dtype = kv_cache_dtype_name(getattr(cache_config, "cache_dtype", "auto"), dtype)
        args = (cache_config.block_size, self.num_kv_heads, self.head_size, dtype)
        if self.sliding_window is None:
            return FullAttentionSpec(*args)
        return SlidingWindowSpec(*args, sliding_window=self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D], over this layer's pages of the pool."""
        kv_cache, meta = self.cache_entry(batch)
        return self.attend(q, k, v, kv_cache, meta)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``forward`` on an explicit page tensor and metadata."""
        flat, rows_per_block = flat_cache_view(kv_cache)
        scaled = is_scaled_kv(flat.dtype)
        if scaled:
            self._maybe_calibrate(k, v, flat.dtype, meta)
            rows = meta.write_rows(rows_per_block)
            if _use_c_kv_write(k, v):
                cpu_kernels.kv_write_8bit(k, v, flat, rows, self.k_scale, self.v_scale)
            else:
                # index_copy_ has no float8 kernel: write the bytes through uint8 views.
                kv = torch.cat(
                    (quantize_kv(k, flat.dtype, self.k_scale), quantize_kv(v, flat.dtype, self.v_scale))
                )
                flat.view(torch.uint8).index_copy_(0, rows, kv.view(torch.uint8))
        else:
            flat.index_copy_(0, meta.write_rows(rows_per_block), torch.cat((k, v)).to(flat.dtype))
        out = torch.empty_like(q)
        if cpu_kernels.batch_invariant() and self._use_c_prefill(q, kv_cache):
            # Decodes, drafts being verified and prompt chunks all through the prefill kernel: a query's
            # attention then does not depend on what its step holds or how its prompt was chunked.
            self._c_prefill(q, kv_cache, *meta.chunks_batch(), out, scaled, None, meta.page_epochs)
            return out.view(q.shape[0], -1)
        c_kernels = _use_c_kernel(kv_cache)
        decode_batch = meta.decode_batch() if c_kernels else None
        if decode_batch is not None:
            tokens, table, lens = decode_batch
            k_scale, v_scale = (self.k_scale, self.v_scale) if scaled else (1.0, 1.0)
            o = cpu_kernels.paged_decode(
                q[tokens].float(),
                kv_cache,
                table,
                lens,
                self.scale,
                self.sliding_window,
                k_scale,
                v_scale,
                self.logit_softcap,
                self.sinks,
                meta.page_epochs,
            )
            out[tokens] = o.to(q.dtype)
        for i, group in enumerate(meta.decode_groups if decode_batch is None else ()):
            rows = meta.decode_rows(i, rows_per_block)
            out[group.tokens] = self._decode(
                q[group.tokens], flat, rows, meta.decode_mask(i, self.sliding_window)
            )
        if meta.prefills and self._use_c_prefill(q, kv_cache):
            self._c_prefill(q, kv_cache, *meta.prefill_batch(), out, scaled, meta.prefills, meta.page_epochs)
            return out.view(q.shape[0], -1)
        for i, chunk in enumerate(meta.prefills):
            rows = None if chunk.slots is None else meta.prefill_rows(i, rows_per_block)
            out[chunk.start : chunk.end] = self._prefill(i, chunk, q, k, v, flat, rows, meta)
        return out.view(q.shape[0], -1)

    def _c_prefill(self, q, kv_cache, chunks, table, out, scaled: bool, spans, epochs) -> None:
        """The C prefill kernel over ``chunks`` into ``out``; 8-bit pages' V scale applied after, to the
        tokens of ``spans`` (chunks with start / end; None: every token). ``epochs``: the step's page
        epochs (the packed-prefix cache's key), or None."""
        scale = self.scale * (self.k_scale if scaled else 1.0)
        window, cap = self.sliding_window, self.logit_softcap
        cpu_kernels.paged_prefill(q, kv_cache, table, chunks, scale, window, out, cap, self.sinks, epochs)
        if scaled and self.v_scale != 1.0:
            for part in [out] if spans is None else [out[span.start : span.end] for span in spans]:
                part.mul_(self.v_scale)

    def _maybe_calibrate(
        self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> None:
        """Fix k_scale / v_scale from this step's K and V, once, before the first real token is written
        (int8 pages always, fp8 ones with calculate_kv_scales). Only tokens bound for real pages count:
        a warm-up or padding forward writing the null block alone calibrates nothing. A step whose
        real K (or V) are all zero leaves that scale open: zeros read back the same under any scale."""
        if self.kv_scales_settled(dtype):
            return
        real = meta.slot_mapping[: k.shape[0]] >= meta.block_size
        if not bool(real.any()):
            return
        if not bool(real.all()):
            k, v = k[real], v[real]
        if "k" in self._open_scales and (amax := _amax(k)) > 0.0:
            self.k_scale = calibrated_scale(amax, dtype, FP8_K_SCALE_CONSTANT)
            self._open_scales.discard("k")
        if "v" in self._open_scales and (amax := _amax(v)) > 0.0:
            self.v_scale = calibrated_scale(amax, dtype, FP8_V_SCALE_CONSTANT)
            self._open_scales.discard("v")

    @property
    def explicit(self) -> bool:
        """Whether the torch fallbacks of this layer run `softcap_attention` (soft cap or sinks: SDPA takes
        neither); the C kernels take both, so this no longer keeps a layer off them."""
        return self.logit_softcap is not None or self.sinks is not None

    def _use_c_prefill(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """The C prefill kernel: bf16 queries over bf16, fp8 or int8 pages on a CPU with AVX512-BF16,
        whole-row pages, heads contiguous."""
        return (
            q.dtype == torch.bfloat16
            and kv_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.int8)
            and q.stride(2) == 1
            and q.stride(1) == self.head_size
            and _use_c_kernel(kv_cache)
            and cpu_kernels.prefill_supported(self.num_heads, self.num_kv_heads, self.head_size)
        )

    def _decode(
        self, q: torch.Tensor, flat: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A group of decodes at once: gather their padded K/V, then one masked SDPA."""
        n, length = mask.shape[0], mask.shape[-1]
        kv = flat.index_select(0, rows).view(2, n, length, self.num_kv_heads, self.head_size)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        if is_scaled_kv(flat.dtype):
            k, v = dequantize(k, q.dtype, self.k_scale), dequantize(v, q.dtype, self.v_scale)
        group = self.num_heads // self.num_kv_heads
        if self.explicit:
            qg = q.view(n, self.num_kv_heads, group, self.head_size)
            # Query head h is (KV head h // group, row h % group) here: the sinks take the same layout.
            sinks = None if self.sinks is None else self.sinks.view(self.num_kv_heads, group, 1)
            o = softcap_attention(qg, k, v, mask, self.scale, self.logit_softcap, sinks)
            return o.reshape(n, self.num_heads, self.head_size).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.view(n, self.num_kv_heads, group, self.head_size).to(k.dtype),
            k,
            v,
            attn_mask=mask,
            scale=self.scale,
        )
        return o.reshape(n, self.num_heads, self.head_size).to(q.dtype)

    def _prefill(
        self,
        i: int,
        chunk: PrefillChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        flat: torch.Tensor,
        rows: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One chunk through torch's fused CPU attention (flash, GQA without repeating K/V): its
        fresh K/V when it starts at 0, else its whole cached sequence gathered from the pages, with
        the causal mask aligned to the chunk's end. bf16 runs in bf16 where the CPU has native bf16
        (float32 accumulation inside the kernel), else in float32."""
        if rows is None:
            keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            keys, values = flat.index_select(0, rows).view(2, chunk.seq_len, *flat.shape[1:]).unbind(0)
            if is_scaled_kv(flat.dtype):
                keys, values = (
                    dequantize(keys, q.dtype, self.k_scale),
                    dequantize(values, q.dtype, self.v_scale),
                )
        mask = meta.prefill_mask(i, self.sliding_window)
        if self.explicit:
            out = softcap_attention(
                q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                mask,
                self.scale,
                self.logit_softcap,
                None if self.sinks is None else self.sinks.view(self.num_heads, 1, 1),
            )
            return out[0].transpose(0, 1).to(q.dtype)
        dtype = q.dtype if q.dtype == torch.float32 or native_bf16_supported() else torch.float32
        out = F.scaled_dot_product_attention(
            q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0).to(dtype),
            keys.transpose(0, 1).unsqueeze(0).to(dtype),
            values.transpose(0, 1).unsqueeze(0).to(dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1).to(q.dtype)
