"""The per-step LoRA computation: each adapter's delta over its segment of the flat token batch.

The worker orders the step's rows by adapter, so the tokens of one adapter are one contiguous range
``[start, end)`` (`LoRAStep.segments`). Every adapted linear then adds, per segment,
``y[start:end] += (x[start:end] @ A^T) @ B^T`` (scale folded into B): two small matmuls on views, no
gather of tokens and no per-token weights. One adapter over the whole batch is the same two matmuls on
the whole of ``x`` (no slicing). Rows without an adapter, and adapters that do not target a module,
simply have no segment there.
"""

from __future__ import annotations

import torch

from tokenos.lora.adapter import ModuleWeights


class LoRAStep:
    """This step's ``(adapter key, first token, end token)`` segments, shared by every adapted linear."""

    def __init__(self) -> None:
        self.segments: list[tuple[str, int, int]] = []


class LoRALayer:
    """The hook an adapted `Linear` calls with its input and output (``Linear.lora``)."""

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[str, ModuleWeights] = {}  # adapter key -> its pieces for this module

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        segments = self.step.segments
        if not segments:
            return y
        weights = self.weights
        num_tokens = x.shape[0]
        for key, start, end in segments:
            w = weights.get(key)
            if w is None:
                continue
            if start == 0 and end == num_tokens:
                y.addmm_(torch.mm(x, w.a_t), w.b_t)
            else:
                y[start:end].addmm_(torch.mm(x[start:end], w.a_t), w.b_t)
        return y
