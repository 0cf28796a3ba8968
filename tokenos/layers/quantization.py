"""Weight-only quantized linears: weights stay packed in 4 or 8 bits with group-wise fp16 scales.

`QuantizedTensor` is a checkpoint weight in quantized form, ``w[n, k] = q[n, k] * s[n, g] + z[n, g]``
with ``g = k // group``: the one form every source maps into without loss (GGUF Q4_0 / Q4_1 / Q8_0
blocks, GPTQ / AWQ groups, our own online quantization), up to the rounding of s and z to fp16.

`QuantizedWeight` is that tensor packed once for `csrc/qlinear.c` (the layout is described there) and
called like a linear. Decode steps read 4.5-8.5 bits per weight instead of 16 (2-3.6x faster than
oneDNN's bf16 GEMM at M = 1 on this project's AVX512-BF16 machine); at prefill sizes the kernel is
level with it. fp32 activations of many rows instead dequantize the weight with the C kernel (in
pieces, into a reused buffer) and multiply with torch's GEMM, which outruns the fp32 panel there
(`dense_from_rows`). Without the kernel (no compiler, ``TOKENOS_DISABLE_C_KERNELS=1``, a CPU without AVX2, an
odd K or group) the same packed bytes are dequantized with torch ops per call: the reference the
kernel is tested against, slow but exact.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenos.layers import cpu_kernels
from tokenos.platform import cpu_info, native_bf16_supported

# Weight-only methods that quantize a dense checkpoint at load (vLLM's --quantization names).
ONLINE_METHODS = ("int8", "int4")

# fp32 activations of at least this many rows take dequantize + torch's GEMM (see `dense_from_rows`).
# With AVX-512, torch's fp32 GEMM runs 16-lane FMAs where csrc/qlinear.c's fp32 panel runs 8:
# dequantize + GEMM is level with the panel at M = 64, 1.4-1.7x it at 128 and 2.1-3.1x at 512-2048 on
# SmolLM2's shapes (Xeon with AMX, 2 vCPUs); on an AVX2 EPYC (Zen 2) the panel was ahead at M = 64,
# level at 512 and 0.78-0.89x dense at 2048 (`tokenos bench kernels --sections linear --dtype float32`,
# with TOKENOS_QUANT_DENSE_FROM set high for the panel alone).
DENSE_FROM_ROWS_AVX512 = 64
DENSE_FROM_ROWS_AVX2 = 512
# The dense weight is made in pieces of at most this many floats (8 MiB), reused by every call.
SCRATCH_FLOATS = 1 << 21


@dataclass
class QuantizedTensor:
    """``w[n, k] = q[n, k] * scales[n, k // group] + zeros[n, k // group]`` (zeros None: 0)."""

    q: torch.Tensor  # [N, K]: uint8 in 0..15 (bits 4) or int8 (bits 8)
    scales: torch.Tensor  # [N, K // group]
    zeros: torch.Tensor | None
    bits: int
    group: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 4 or 8 bits, not {self.bits}")
        if k % self.group:
            raise ValueError(f"group size {self.group} does not divide the {k} input columns")
        expected = (n, k // self.group)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is not None and tuple(t.shape) != expected:
                raise ValueError(f"{name} of shape {tuple(t.shape)}; expected {expected}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight."""
        return _dequantize(self.q, self.scales, self.zeros, self.group)

    def map_rows(self, fn) -> QuantizedTensor:
        """The tensor with a row-only transform (a permutation, a slice) applied to q, scales and zeros."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return QuantizedTensor(fn(self.q), fn(self.scales), zeros, self.bits, self.group)

    def scaled(self, factor: float | torch.Tensor) -> QuantizedTensor:
        """``factor * w`` (``factor`` a number or one value per row): scales and zeros scale with it."""
        f = torch.as_tensor(factor, dtype=torch.float32)
        f = f.reshape(-1, 1) if f.dim() else f
        zeros = None if self.zeros is None else self.zeros.float() * f
        return QuantizedTensor(self.q, self.scales.float() * f, zeros, self.bits, self.group)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stack along rows (fused q/k/v, gate/up). Shards quantized differently (a GGUF Q4_K_M file's
        Q4_K q / k beside a Q6_K v) meet exactly in the wider form: int4 values held as int8, groups
        split to the common divisor (each scale and zero repeated)."""
        bits = max(p.bits for p in parts)
        group = math.gcd(*(p.group for p in parts))
        parts = [p.regrouped(bits, group) for p in parts]
        if any(p.zeros is not None for p in parts):
            parts = [p if p.zeros is not None else _with_zeros(p) for p in parts]
        zeros = None if parts[0].zeros is None else torch.cat([p.zeros.float() for p in parts])
        q = torch.cat([p.q for p in parts])
        return QuantizedTensor(q, torch.cat([p.scales.float() for p in parts]), zeros, bits, group)

    def regrouped(self, bits: int, group: int) -> QuantizedTensor:
        """The same weights in ``bits`` >= self.bits and a ``group`` dividing self.group (exact)."""
        if (bits, group) == (self.bits, self.group):
            return self
        q = self.q.to(torch.int8) if bits == 8 and self.bits == 4 else self.q
        repeat = self.group // group
        zeros = None if self.zeros is None else self.zeros.repeat_interleave(repeat, dim=1)
        return QuantizedTensor(q, self.scales.repeat_interleave(repeat, dim=1), zeros, bits, group)


def _with_zeros(t: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(t.q, t.scales, torch.zeros_like(t.scales), t.bits, t.group)


def _dequantize(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int
) -> torch.Tensor:
    s = scales.float().repeat_interleave(group, dim=-1)
    w = q.float() * s
    return w if zeros is None else w + zeros.float().repeat_interleave(group, dim=-1)


def quantize(weight: torch.Tensor, bits: int, group: int | None = None) -> QuantizedTensor:
    """Online weight-only quantization of a dense [N, K] weight: int8 symmetric (zeros None), int4
    asymmetric (min/max, as GGUF's Q4_1), per group of ``group`` input columns (default: 128 for int8,
    32 for int4, or the whole row where that does not divide K)."""
    n, k = weight.shape
    group = group or _default_group(k, 128 if bits == 8 else 32)
    w = weight.detach().float().reshape(n, k // group, group)
    if bits == 8:
        scales = (w.abs().amax(-1) / 127).half().float()
        q = torch.round(w / _nonzero(scales)[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedTensor(q.reshape(n, k), scales.half(), None, 8, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15).half().float()
    zeros = lo.half().float()
    q = torch.round((w - zeros[..., None]) / _nonzero(scales)[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensor(q.reshape(n, k), scales.half(), zeros.half(), 4, group)


def _default_group(k: int, preferred: int) -> int:
    return next((g for g in (preferred, 64, 32) if g <= preferred and k % g == 0), k)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales == 0, torch.ones_like(scales), scales)


# Dtypes csrc/qlinear.c's qrows_desc writes (its out_bf16 flag).
_ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class QuantizedWeight:
    """A `QuantizedTensor` packed for the kernel; ``qw(x, bias)`` -> ``x W^T + b`` in x's dtype."""

    def __init__(self, t: QuantizedTensor) -> None:
        self.bits, self.group = t.bits, t.group
        self.shape = t.shape
        n, k = t.shape
        padded = -n % 16
        q = F.pad(t.q, (0, 0, 0, padded))
        scales = F.pad(t.scales.half(), (0, 0, 0, padded))
        self.cells = _pack_cells(q, t.bits)
        self.scales = _pack_groups(scales)
        self.zeros = None if t.zeros is None else _pack_groups(F.pad(t.zeros.half(), (0, 0, 0, padded)))
        self._desc = self._describe()
        self._desc_address = ctypes.addressof(self._desc)
        self._gemms = self._kernels()

    @property
    def nbytes(self) -> int:
        tensors = (self.cells, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def unpack(self) -> QuantizedTensor:
        """The logical tensor back (the inverse of packing; the reference for the kernel's layout)."""
        n, k = self.shape
        q = _unpack_cells(self.cells, self.bits)[:n, :k]
        zeros = None if self.zeros is None else _unpack_groups(self.zeros)[:n]
        return QuantizedTensor(q, _unpack_groups(self.scales)[:n], zeros, self.bits, self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight in ``dtype``."""
        return self.unpack().dequantize().to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup), [*ids.shape, K]."""
        kernel = cpu_kernels.qrows_kernel() if self._gemms and dtype in _ROW_DTYPES else None
        if kernel is not None and self.shape[1] % self.group == 0:
            flat = ids.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(flat.shape[0], self.shape[1], dtype=dtype)
            if kernel(self._desc_address, flat.data_ptr(), flat.shape[0], out.data_ptr(), _ROW_DTYPES[dtype]):
                raise IndexError(f"row ids out of range for a table of {self.shape[0]} rows")
            return out.reshape(*ids.shape, -1)
        return self._rows_reference(ids, dtype)

    def _rows_reference(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`rows` in torch ops (the kernel's reference, and its fallback)."""
        flat = ids.reshape(-1).long()
        blk, lane = flat // 16, flat % 16
        half, r = lane // 8, lane % 8
        nb, pairs, _ = self.cells.shape
        if self.bits == 4:
            # Row r's bytes in each double cell: 16 * half + 2 * (r % 8) + t; low nibble the even pair.
            cells = self.cells.view(nb, pairs // 2, 2, 8, 2)[blk, :, half, r, :]
            q = torch.stack([cells & 15, cells >> 4], dim=2)
        else:
            q = self.cells.view(nb, pairs, 2, 8, 2)[blk, :, half, r, :]
        zeros = None if self.zeros is None else self.zeros[blk, :, lane]
        q = q.reshape(len(flat), -1)[:, : self.shape[1]]
        w = _dequantize(q, self.scales[blk, :, lane], zeros, self.group)
        return w.to(dtype).reshape(*ids.shape, -1)

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        n, k = self.shape
        gemm = self._gemms.get(x.dtype)
        if gemm is None and x.dtype == torch.bfloat16 and torch.float32 in self._gemms:
            # bf16 activations without the bf16 kernel (AVX2): the fp32 one, as linear._upcast_linear.
            return self(x.float(), None if bias is None else bias.float(), out_dtype)
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        m = x2.shape[0]
        if gemm is None or m == 0 or x2.stride(-1) != 1:
            return self._reference(x2, bias, out_dtype).reshape(*x.shape[:-1], n)
        # Called per layer per step: one allocation and one kernel call of few arguments.
        # Batch invariance keeps every row count on the kernel: torch's GEMM picks its own blocking by M.
        if x.dtype == torch.float32 and m >= dense_from_rows() and not cpu_kernels.batch_invariant():
            out = self._dense_gemm(x2)
            if out_dtype != torch.float32:
                out = out.to(out_dtype)
        elif x.dtype == torch.bfloat16:
            f32 = out_dtype == torch.float32
            out = torch.empty((m, n), dtype=torch.float32 if f32 else torch.bfloat16)
            gemm(self._desc_address, x2.data_ptr(), m, x2.stride(0), out.data_ptr(), n, f32)
        else:
            out = torch.empty((m, n), dtype=torch.float32)
            gemm(self._desc_address, x2.data_ptr(), m, x2.stride(0), out.data_ptr(), n)
            if out_dtype != torch.float32:
                out = out.to(out_dtype)
        if bias is not None:
            out += bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``x W^T`` as float32 (int64 [rows]), the products never stored: what
        ``self(x, out_dtype=torch.float32).argmax(1)`` gives. None where the bf16 kernel does not take
        x (then compute the products)."""
        if x.dtype != torch.bfloat16 or torch.bfloat16 not in self._gemms:
            return None
        if x.dim() != 2 or x.shape[0] == 0 or x.stride(-1) != 1:
            return None
        kernel = cpu_kernels.qargmax_kernel()
        if kernel is None:
            return None
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        kernel(self._desc_address, x.data_ptr(), x.shape[0], x.stride(0), ids.data_ptr())
        return ids

    def _dense_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for many fp32 rows: the weight dequantized by the C kernel in pieces of rows (exactly
        `dequantize`'s floats) and multiplied with torch's GEMM, which is faster there than the panel."""
        n, k = self.shape
        piece = min(n, max(16, SCRATCH_FLOATS // k // 16 * 16))
        scratch = _scratch(piece * k)
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        for n0 in range(0, n, piece):
            n1 = min(n, n0 + piece)
            w = scratch[: (n1 - n0) * k].view(n1 - n0, k)
            cpu_kernels.qdequant_kernel()(self._desc_address, n0, n1, w.data_ptr())
            torch.mm(x, w.t(), out=out if piece == n else out[:, n0:n1])
        return out

    def _reference(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """Dequantize and F.linear: the torch path (and, for bf16 on a CPU without native bf16, its
        upcast, as linear._upcast_linear)."""
        compute = x.dtype
        if compute == torch.bfloat16 and not native_bf16_supported():
            compute = torch.float32
        weight = self.dequantize(compute)
        out = F.linear(x.to(compute), weight, None if bias is None else bias.to(compute))
        return out.to(out_dtype)

    def _kernels(self) -> dict[torch.dtype, object]:
        """Activation dtype -> csrc/qlinear.c's kernel for it, where the CPU and this shape allow."""
        # The kernel reads column pairs (int4: two at a time), which must not straddle two groups.
        step = 4 if self.bits == 4 else 2
        if self.shape[1] % step or self.group % step:
            return {}
        dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16_supported() else [])
        found = {dtype: cpu_kernels.qgemm_kernel(dtype) for dtype in dtypes}
        return {dtype: fn for dtype, fn in found.items() if fn is not None}

    def _describe(self) -> cpu_kernels.QDesc:
        """The kernel's description of these packed bytes (kept alive with them)."""
        n, k = self.shape
        zeros = None if self.zeros is None else self.zeros.data_ptr()
        return cpu_kernels.QDesc(
            self.cells.data_ptr(), self.scales.data_ptr(), zeros, self.bits, self.group, k, n
        )


def dense_from_rows() -> int:
    """From how many fp32 activation rows a quantized linear dequantizes its weight and multiplies with
    torch's GEMM instead of running csrc/qlinear.c's panel (``TOKENOS_QUANT_DENSE_FROM`` overrides)."""
    return _dense_from_rows(os.environ.get("TOKENOS_QUANT_DENSE_FROM"))


@functools.cache
def _dense_from_rows(override: str | None) -> int:
    if override is not None:
        return int(override)
    avx512 = "avx512f" in cpu_info()[1]
    return DENSE_FROM_ROWS_AVX512 if avx512 else DENSE_FROM_ROWS_AVX2


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least ``numel`` floats, kept between calls (no page faults)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def _pack_cells(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[N (multiple of 16), K] values -> the kernel's cells [N / 16, K / 2, 16] (int4: bytes of double
    cells, two pairs per 32) or [N / 16, K / 2, 32] (int8); see qlinear.c."""
    n, k = q.shape
    whole = 4 if bits == 4 else 2
    if k % whole:
        # A K the kernel cannot take (it runs on the torch path): padded to whole cells; the pad is never
        # read as a weight.
        q = F.pad(q, (0, -k % whole))
        k = q.shape[1]
    nb = n // 16
    if bits == 4:
        # [block, half (B / A), row, double cell, parity, t] -> [block, double cell, parity, lane].
        v = (
            q.to(torch.uint8)
            .reshape(nb, 2, 8, k // 4, 2, 2)
            .permute(0, 3, 4, 1, 2, 5)
            .reshape(nb, k // 4, 2, 32)
        )
        return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(nb, k // 2, 16).contiguous()
    v = q.to(torch.int8).reshape(nb, 2, 8, k // 2, 2)
    return v.permute(0, 3, 1, 2, 4).reshape(nb, k // 2, 32).contiguous()


def _unpack_cells(cells: torch.Tensor, bits: int) -> torch.Tensor:
    nb, pairs, _ = cells.shape
    if bits == 4:
        dc = cells.reshape(nb, pairs // 2, 32)
        v = torch.stack([dc & 15, dc >> 4], dim=2).reshape(nb, pairs // 2, 2, 2, 8, 2)
        return v.permute(0, 3, 4, 1, 2, 5).reshape(nb * 16, pairs * 2)
    v = cells.reshape(nb, pairs, 2, 8, 2).permute(0, 2, 3, 1, 4)
    return v.reshape(nb * 16, pairs * 2)


def _pack_groups(v: torch.Tensor) -> torch.Tensor:
    """[N (multiple of 16), groups] fp16 -> [N / 16, groups, 16]."""
    n, g = v.shape
    return v.reshape(n // 16, 16, g).permute(0, 2, 1).contiguous()


def _unpack_groups(v: torch.Tensor) -> torch.Tensor:
    nb, g, _ = v.shape
    return v.permute(0, 2, 1).reshape(nb * 16, g)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int, dict[str, int]]:
    """(total bytes of the weights as held, bytes of the quantized ones, quantized tensors by kind
    ("int4", "int8")): what the start-up log reports. Shared tensors (a tied head) count once."""
    seen: set[int] = set()
    total = quantized = 0
    kinds: dict[str, int] = {}
    for module in model.modules():
        own = getattr(module, "quantized", None)
        if isinstance(own, dict):  # per-expert weights: name -> [expert] -> QuantizedWeight
            held = [w for weights in own.values() for w in weights]
        else:
            held = [own]
        held += [getattr(getattr(module, "packed", None), "weight", None), *module.parameters(recurse=False)]
        for t in held:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, QuantizedWeight):
                quantized += t.nbytes
                kinds[f"int{t.bits}"] = kinds.get(f"int{t.bits}", 0) + 1
                total += t.nbytes
            else:
                total += t.numel() * t.element_size()
    return total, quantized, kinds
