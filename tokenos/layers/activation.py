"""SiLU-and-mul: the gated MLP activation on a fused [gate | up] projection (one C pass where the
kernels are built, csrc/step_ops.c; the torch code is the reference and fallback). GELU(tanh)-and-mul
(Gemma's ``gelu_pytorch_tanh``) is torch only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers import cpu_kernels


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(x[..., :d]) * x[..., d:] for x of width 2d (Gemma's ``gelu_pytorch_tanh`` gate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
