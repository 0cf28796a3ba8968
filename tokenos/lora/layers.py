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

Merged. When every token of a step belongs to one adapter (`LoRAStep.merged`, chosen by the manager),
a linear whose base weight is dense runs from a copy with the adapter merged in, ``W + B A`` (float32
sum, rounded once to the model's dtype, packed like the base), so the step costs what the base model
does. One adapter's copies exist at a time; quantized base weights are never merged (that would mean
running dense) and keep the segment path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenos.layers import cpu_kernels
from tokenos.lora.adapter import ModuleWeights

if TYPE_CHECKING:
    from tokenos.layers.linear import Linear

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
        # The adapter every token of this step uses, when the linears should run it merged.
        self.merged: str | None = None

    def set(self, segments: list[tuple[str, int, int]], merged: str | None = None) -> None:
        self.segments = segments
        self.merged = merged
        self.starts = (ctypes.c_int64 * len(segments))(*(s for _, s, _ in segments))
        self.ends = (ctypes.c_int64 * len(segments))(*(e for _, _, e in segments))


class LoRALayer:
    """What an adapted `Linear` runs instead of its base forward (``Linear.lora``)."""

    def __init__(self, step: LoRAStep, linear: Linear) -> None:
        self.step = step
        self.linear = linear
        self.weights: dict[str, ModuleWeights] = {}  # adapter key -> its pieces for this module
        # The merged copy's adapter and its forward; (key, None) once a key proved unmergeable here.
        self.merged_key: str | None = None
        self.merged: Callable[[torch.Tensor], torch.Tensor] | None = None

    def add(self, key: str, weights: ModuleWeights) -> None:
        weights.desc = make_desc(weights)
        self.weights[key] = weights

    def drop(self, key: str) -> None:
        self.weights.pop(key, None)
        if self.merged_key == key:
            self.merged_key = self.merged = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapted linear's output: merged where this step runs merged, else base plus deltas."""
        key = self.step.merged
        if key is not None and key in self.weights:
            merged = self.merged_forward(key)
            if merged is not None:
                return merged(x)
        return self(x, self.linear.base_forward(x))

    def merged_forward(self, key: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The forward with ``key`` merged into the base weight (made now if it is not the one held),
        or None where the base weight is quantized."""
        if self.merged_key != key:
            self.merged_key, self.merged = key, None  # the old copy goes first: one at a time
            base = self.linear.dense_weight()
            if base is not None:
                self.merged = self.linear.with_weight(merge(base, self.weights[key]))
        return self.merged

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


def merge(base: torch.Tensor, w: ModuleWeights) -> torch.Tensor:
    """``base + B A`` over the adapted rows, summed in float32 and rounded once to base's dtype."""
    merged = base.to(torch.float32, copy=True)
    a = w.a.float()
    for p in w.pieces:
        merged[p.offset : p.offset + p.size].addmm_(p.bt.float().t(), a[p.r0 : p.r0 + p.rows])
    return merged.to(base.dtype)


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
