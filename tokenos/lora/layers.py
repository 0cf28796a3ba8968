"""The per-step LoRA computation: each adapter's delta over its segment of the flat token batch.

The worker orders the step's rows by adapter, so the tokens of one adapter are one contiguous range
``[start, end)`` (`LoRAStep.segments`). Every adapted linear then adds, per segment,
``y[start:end] += (x[start:end] @ A^T) @ B^T`` (scale folded into B), per adapted shard into its own
output columns: no gather of tokens and no per-token weights. Rows without an adapter, and adapters that
do not target a module, simply have no segment there.

Short segments (decode: a few tokens per adapter) take the C kernel (``csrc/lora.c``: one call per
segment, float32 arithmetic rounded once into ``y``), where torch's two matmuls on a few tens of columns
cost more in dispatch than in work; long ones (prefill), or every one without the kernel, take torch's
GEMMs (`apply_matmul`). `apply_torch` is the kernel's float32 reference.
"""

from __future__ import annotations

import ctypes

import torch

from tokenos.layers import cpu_kernels
from tokenos.lora.adapter import ModuleWeights

# Segments up to this many tokens take the C kernel; longer ones torch's GEMMs (measured single-threaded
# on a Zen 4 core, bf16, SmolLM2's shapes: the kernel 1.2-2x faster at 16 tokens, 1.5-2.4x slower at 64).
KERNEL_MAX_TOKENS = 32


class LoRAStep:
    """This step's ``(adapter key, first token, end token)`` segments, shared by every adapted linear."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, int, int]] = []


class LoRALayer:
    """The hook an adapted `Linear` calls with its input and output (``Linear.lora``)."""

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[str, ModuleWeights] = {}  # adapter key -> its pieces for this module

    def add(self, key: str, weights: ModuleWeights) -> None:
        weights.desc = make_desc(weights)
        self.weights[key] = weights

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        segments = self.step.segments
        if not segments:
            return y
        kernel, _ = cpu_kernels.lora_kernel(y.dtype)
        fast = kernel is not None and x.dtype == y.dtype and x.stride(-1) == 1 and y.stride(-1) == 1
        for key, start, end in segments:
            w = self.weights.get(key)
            if w is None:
                continue
            if fast and end - start <= KERNEL_MAX_TOKENS and w.desc is not None and w.a.dtype == y.dtype:
                kernel(
                    x.data_ptr() + start * x.stride(0) * x.element_size(),
                    x.stride(0),
                    y.data_ptr() + start * y.stride(0) * y.element_size(),
                    y.stride(0),
                    end - start,
                    w.desc[0],
                )
            else:
                apply_matmul(x[start:end], y[start:end], w)
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
