"""Linear layers that know how to load their own weights.

``Linear`` is a plain y = x W^T + b. ``QKVLinear`` and ``MergedLinear`` fuse several
checkpoint matrices (q/k/v, gate/up) into one matmul; their ``weight_loader`` takes a
``shard_id`` and copies the checkpoint tensor into its rows of the fused parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.weights import copy_rows, make_param
from tokenos.platform import native_bf16_supported


class Linear(nn.Module):
    """y = x W^T (+ b); the weight has the checkpoint's [out, in] layout."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = make_param(output_size, input_size)
        self.bias = make_param(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and not native_bf16_supported():
            return _upcast_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 matmul on a CPU without bf16 arithmetic (AVX2): torch's bf16 GEMM runs 5-30x slower
    than fp32 there. The weights stay bf16 in memory; each call upcasts them (cheap next to the
    GEMM), accumulates in fp32 as oneDNN does internally on such CPUs, and rounds the result to bf16."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


class MergedLinear(Linear):
    """Several linears sharing an input, stacked along the output (shard_id = index)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        for p in self.parameters():
            p.weight_loader = self.weight_loader
            p.shard_ids = self.shard_ids()

    def shard_ids(self) -> tuple[int | str, ...]:
        """The shard ids a complete checkpoint provides for this module's parameters."""
        return tuple(range(len(self.output_sizes)))

    def shard_offset(self, shard_id: int | str) -> tuple[int, int]:
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str) -> None:
        copy_rows(param, loaded, *self.shard_offset(shard_id))


class QKVLinear(MergedLinear):
    """Fused q, k, v projections (shard_id "q" / "k" / "v"); GQA means k and v are narrower."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def shard_ids(self) -> tuple[int | str, ...]:
        return ("q", "k", "v")

    def shard_offset(self, shard_id: int | str) -> tuple[int, int]:
        return super().shard_offset({"q": 0, "k": 1, "v": 2}[shard_id])
