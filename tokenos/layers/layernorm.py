"""RMSNorm, optionally fused with the residual add that precedes it (as in vLLM/nano-vllm).

The C kernel (csrc/step_ops.c) does the add and the norm in one pass, rounding where these torch
ops round; the torch code below is the reference it is tested against and the fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers import cpu_kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight; ``forward(x, residual)`` first adds and returns the new residual too."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        # Subclasses that change the formula (offset weights, one rounding) keep their own `norm`.
        self._fusable = type(self).norm is RMSNorm.norm

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Match transformers: normalise in float32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._fusable and cpu_kernels.usable(x, self.weight, *([] if residual is None else [residual])):
            out, new_residual = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32 and rounded once at the end, as
    transformers' Gemma2/Gemma3RMSNorm do (checkpoints store the offset ``weight``, zero at init). Its
    own ``norm`` keeps it off the fused C kernel, which scales by ``weight`` and rounds before it."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
