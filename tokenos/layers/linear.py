"""Linear layers that know how to load their own weights, and run from oneDNN-packed weights.

``Linear`` is a plain y = x W^T + b. ``QKVLinear`` and ``MergedLinear`` fuse several
checkpoint matrices (q/k/v, gate/up) into one matmul; their ``weight_loader`` takes a
``shard_id`` and copies the checkpoint tensor into its rows of the fused parameter.

Packing. Once the checkpoint is loaded, ``pack()`` reorders the weight ONCE into oneDNN's blocked
layout for this CPU (``torch.ops.mkldnn._reorder_linear_weight``) and drops the plain copy; every call
then runs ``_linear_pointwise`` on it. Measured with ``tokenos bench kernels``-style shapes on an AVX-512
BF16 CPU: 1.3-2.4x faster than ``F.linear`` for the decode rows (M = 1..64), even for M = 2048, in bf16
and float32 alike. On a CPU without native bf16 a bf16 model's weights are packed in float32 (its
arithmetic there is emulated and 5-30x slower): activations go in as float32, results are rounded to
bf16. ``TOKENOS_PACK_LINEARS=0`` keeps the plain ``F.linear`` path (the reference).

Quantization. A weight (or each shard of a fused one) may arrive as a `QuantizedTensor` (GGUF blocks,
GPTQ / AWQ groups): it is held aside, never dequantized, and ``pack()`` turns it
into a `QuantizedWeight` the layer runs from (see `tokenos.layers.quantization`). ``pack("int8")`` /
``pack("int4")`` quantize a dense weight at load instead. Shards quantized differently stack in the
wider form (`QuantizedTensor.cat`); a fused layer whose shards came partly quantized and partly dense
(a GGUF beside a block type it dequantizes) runs dense, with the quantized shards dequantized into it:
exact, at the dense size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.quantization import ONLINE_METHODS, QuantizedTensor, QuantizedWeight, quantize
from tokenos.layers.weights import copy_rows, default_weight_loader, make_param
from tokenos.platform import native_bf16_supported

if TYPE_CHECKING:
    from tokenos.lora.layers import LoRALayer


class Linear(nn.Module):
    """y = x W^T (+ b); the weight has the checkpoint's [out, in] layout."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = make_param(output_size, input_size)
        self.bias = make_param(output_size) if bias else None
        self.weight.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None
        self.quantized: QuantizedWeight | None = None
        # Shard id (None: the whole weight) -> its quantized checkpoint tensor, until pack().
        self.quantized_shards: dict[int | str | None, QuantizedTensor] = {}
        # Multi-LoRA: runs this layer with the step's adapters instead of the base forward alone.
        self.lora: LoRALayer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_forward(x) if self.lora is None else self.lora.forward(x)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b from the base weights alone (no adapter)."""
        if self.quantized is not None:
            return self.quantized(x, self.bias)
        if self.packed is not None:
            return self.packed(x, self.bias)
        return _plain_linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor | None:
        """The base weight [out, in] as a plain tensor in the model's dtype (unpacked from oneDNN's
        layout, exactly), or None where it is held quantized."""
        if self.quantized is not None:
            return None
        if self.packed is not None:
            return self.packed.weight.to_dense().to(self.packed.out_dtype)
        return self.weight.detach()

    def with_weight(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> x weight^T + b``, run the way this layer runs its own dense weight (oneDNN-packed
        where it is): a merged LoRA copy (`tokenos.lora.layers`)."""
        bias = self.bias
        if self.packed is not None:
            packed = PackedWeight(weight)
            return lambda x: packed(x, bias)
        return lambda x: _plain_linear(x, weight, bias)

    def shard_ids(self) -> tuple[int | str | None, ...]:
        """The shard ids a complete checkpoint provides for this module's weight."""
        return (None,)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if isinstance(loaded, QuantizedTensor) and param is self.weight:
            self._check_shard_shape(loaded.shape, shard_id)
            self.quantized_shards[shard_id] = loaded
        elif isinstance(loaded, QuantizedTensor):
            raise ValueError("only a linear's weight can be quantized")
        else:
            self.load_dense(param, loaded, shard_id)

    def load_dense(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None) -> None:
        default_weight_loader(param, loaded)

    def _check_shard_shape(self, shape: tuple[int, int], shard_id: int | str | None) -> None:
        expected = (
            tuple(self.weight.shape)
            if shard_id is None
            else (self.shard_offset(shard_id)[1], self.weight.shape[1])
        )
        if tuple(shape) != expected:
            raise ValueError(f"checkpoint tensor of shape {tuple(shape)} does not fit {expected}")

    def pack(self, quantization: str | None = None) -> None:
        """Get ready to serve, once loaded: run from the quantized checkpoint weight if it came so, from
        a weight quantized now if ``quantization`` is "int8" / "int4", or else from a oneDNN-packed copy
        (where packing is on); the plain weight is dropped in all three cases."""
        if self.quantized_shards:
            self._pack_quantized()
        elif quantization in ONLINE_METHODS and self.weight is not None:
            self.quantized = QuantizedWeight(
                quantize(self.weight.detach(), 8 if quantization == "int8" else 4)
            )
            self.weight = None
        if self.quantized is not None:
            return
        if self.packed is None and packing_enabled():
            self.packed = PackedWeight(self.weight.detach())
            self.weight = None
            if self.bias is not None and self.packed.compute_dtype != self.bias.dtype:
                self.bias.data = self.bias.data.to(self.packed.compute_dtype)

    def _pack_quantized(self) -> None:
        shards = self.quantized_shards
        self.quantized_shards = {}
        order = self.shard_ids()
        if set(shards) == set(order):
            self.quantized = QuantizedWeight(QuantizedTensor.cat([shards[i] for i in order]))
            self.weight = None
            return
        for shard_id, t in shards.items():  # mixed with dense shards: run dense
            self.load_dense(self.weight, t.dequantize(), shard_id)


def packing_enabled() -> bool:
    return os.environ.get("TOKENOS_PACK_LINEARS", "1") != "0" and torch.backends.mkldnn.is_available()


class PackedWeight:
    """A [out, in] weight reordered once for oneDNN; called as ``packed(x, bias)`` -> x W^T + b."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_dtype = weight.dtype
        self.compute_dtype = (
            torch.float32 if weight.dtype == torch.bfloat16 and not native_bf16_supported() else weight.dtype
        )
        self.shape = tuple(weight.shape)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype), None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(
            x.to(self.compute_dtype).contiguous(), self.weight, bias, "none", [], ""
        )
        return out.to(x.dtype) if out.dtype != x.dtype else out


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and not native_bf16_supported():
        return _upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


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

    def load_dense(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None) -> None:
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
