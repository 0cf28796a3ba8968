"""The per-step LoRA computation: each adapter's delta over its segment of the flat token batch.

The worker orders the step's rows by adapter, so the tokens of one adapter are one contiguous range
``[start, end)`` (`LoRAStep.segments`). Every adapted linear then adds, per segment,
``y[start:end] += (x[start:end] @ A^T) @ B^T`` (scale folded into B), per adapted shard into its own
output columns: no gather of tokens and no per-token weights. Rows without an adapter, and adapters that
do not target a module, simply have no segment there.

Small segments (decode: a few tokens per adapter) take the C kernel (``csrc/lora.c``: one call for all
of them, float32 arithmetic rounded once into ``y``), where torch's two matmuls on a few tens of columns
cost more in dispatch than in work; long ones (prefill), or every one without the kernel, take torch's
GEMMs (`apply_matmul`). `apply_torch` is the kernel's float32 reference.
"""

from __future__ import annotations

import ctypes

import torch

from tokenos.layers import cpu_kernels
from tokenos.lora.adapter import ModuleWeights

# A segment whose multiply-adds (tokens x (rank x in + sum of rows x size)) stay under this takes the C
# kernel, a larger one torch's GEMMs. Measured on 2 Zen 4 threads, bf16, SmolLM2's shapes at rank 16:
# torch costs 45-140 us whatever the size, the kernel 12-18 us per million (AVX512-BF16); they cross
# near 8 million (gate_up at 128 tokens).
KERNEL_MAX_MACS = 8_000_000


class LoRAStep:
    """This step's ``(adapter key, first token, end token)`` segments, shared by every adapted linear
    (with their bounds as the kernel's int64 arrays)."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, int, int]] = []
        self.starts = self.ends = (ctypes.c_int64 * 0)()

    def set(self, segments: list[tuple[str, int, int]]) -> None:
        self.segments = segments
        self.starts = (ctypes.c_int64 * len(segments))(*(s for _, s, _ in segments))
        self.ends = (ctypes.c_int64 * len(segments))(*(e for _, _, e in segments))


class LoRALayer:
    """The hook an adapted `Linear` calls with its input and output (``Linear.lora``)."""

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[str, ModuleWeights] = {}  # adapter key -> its pieces for this module

    def add(self, key: str, weights: ModuleWeights) -> None:
        weights.desc = make_desc(weights)
        self.weights[key] = weights

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if not step.segments:
            return y
        kernel, _ = cpu_kernels.lora_kernel(y.dtype)
        fast = kernel is not None and x.dtype == y.dtype and x.stride(-1) == 1 and y.stride(-1) == 1
        descs: list[int | None] = []  # per segment: the kernel's descriptor, None where it does not run
        for key, start, end in step.segments:
            w = self.weights.get(key)
            small = w is not None and (end - start) * w.macs_per_token <= KERNEL_MAX_MACS
            if fast and small and w.desc is not None and w.a.dtype == y.dtype:
                descs.append(w.desc[0])
                continue
            descs.append(None)
            if w is not None:
                apply_matmul(x[start:end], y[start:end], w)
        if any(descs):
            pointers = (ctypes.c_void_p * len(descs))(*descs)
            kernel(
                x.data_ptr(),
                x.stride(0),
                y.data_ptr(),
                y.stride(0),
                len(descs),
                step.starts,
                step.ends,
                pointers,
            )
        return y


def apply_matmul(x: torch.Tensor, y: torch.Tensor, w: ModuleWeights) -> None:
    """Long segments (prefill): torch's GEMMs, whose dispatch cost is small next to their work there."""
    t = torch.mm(x, w.a.t())
    for p in w.pieces:
        y[:, p.offset : p.offset + p.size].addmm_(t[:, p.r0 : p.r0 + p.rows], p.bt)


def apply_torch(x: torch.Tensor, y: torch.Tensor, w: ModuleWeights) -> None:
    """The kernel's reference (its tests): float32 shrink and expand, one rounding into ``y``."""
    t = x.float() @ w.a.float().t()
    for p in w.pieces:
        cols = y[:, p.offset : p.offset + p.size]
        cols.copy_(cols.float().addmm_(t[:, p.r0 : p.r0 + p.rows], p.bt.float()))


def make_desc(w: ModuleWeights) -> tuple[int, cpu_kernels.LoRADesc] | None:
    """The kernel's descriptor of ``w`` (its address first), or None where the kernel cannot take it."""
    _, max_rank = cpu_kernels.lora_kernel(w.a.dtype)
    if not max_rank or w.a.shape[0] > max_rank or len(w.pieces) > 3:
        return None
    desc = cpu_kernels.LoRADesc()
    desc.a, desc.rank, desc.K, desc.num_pieces = w.a.data_ptr(), w.a.shape[0], w.a.shape[1], len(w.pieces)
    for slot, p in zip(desc.pieces, w.pieces, strict=False):
        slot.offset, slot.size, slot.r0, slot.rows, slot.bt = p.offset, p.size, p.r0, p.rows, p.bt.data_ptr()
    return ctypes.addressof(desc), desc
