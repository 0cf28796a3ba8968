"""Token embedding and the LM head; a tied head reuses the embedding's weight parameter.

Either may come quantized from the checkpoint (GGUF stores embeddings as Q8_0, Q4_K, ...): the table then
stays packed (`tokenos.layers.quantization`), the lookup dequantizes only the rows it gathers, and a
tied head computes its logits from the same packed bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.linear import PackedWeight, packing_enabled
from tokenos.layers.quantization import ONLINE_METHODS, QuantizedTensor, QuantizedWeight, quantize
from tokenos.layers.weights import default_weight_loader
from tokenos.platform import native_bf16_supported


class _QuantizableTable(nn.Module):
    """A [vocab, hidden] weight that keeps a quantized checkpoint tensor packed."""

    def __init__(self, vocab_size: int, hidden_size: int, allocate: bool = True) -> None:
        super().__init__()
        self.weight = None
        if allocate:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = self._load
        self.dtype = torch.get_default_dtype()  # the model's (it is built under it)
        self.quantized: QuantizedWeight | None = None
        self._pending: QuantizedTensor | None = None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor) -> None:
        if not isinstance(loaded, QuantizedTensor):
            default_weight_loader(param, loaded)
        elif tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
            )
        else:
            self._pending = loaded

    def _pack_quantized(self, quantization: str | None = None) -> bool:
        """Run from the quantized checkpoint table, or (online int8 / int4) quantize the dense one to
        int8: the table is the largest single weight (the LM head's bytes are half of a decode step's
        at int4), and int8 keeps its logits close."""
        if self._pending is None and quantization in ONLINE_METHODS and self.weight is not None:
            self._pending = quantize(self.weight.detach(), 8)
        if self._pending is not None:
            self.quantized = QuantizedWeight(self._pending)
            self._pending = None
            self.weight = None
        return self.quantized is not None


class VocabEmbedding(_QuantizableTable):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(input_ids, self.dtype)
        return F.embedding(input_ids, self.weight)

    def pack(self, quantization: str | None = None) -> None:
        self._pack_quantized(quantization)


class LMHead(_QuantizableTable):
    """hidden -> float32 logits. ``tied_to`` shares the embedding's weight instead of owning one."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, allocate=tied_to is None)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.tied_to = tied_to
        self.packed: PackedWeight | None = None

    @property
    def tied(self) -> bool:
        return self.tied_to is not None

    def pack(self, quantization: str | None = None) -> None:
        """Compute from the packed quantized table if the checkpoint's (or the tied embedding's) came
        quantized, else from a oneDNN-packed copy (see `tokenos.layers.linear`); a tied head keeps the
        embedding's plain weight for the lookup, an untied one drops its own."""
        if self.tied:
            self.tied_to.pack(quantization)
            self.quantized = self.tied_to.quantized
            if self.quantized is not None:
                self.weight = None
        elif self._pack_quantized(quantization):
            return
        if self.quantized is None and self.packed is None and packing_enabled():
            self.packed = PackedWeight(self.weight.detach())
            if not self.tied:
                self.weight = None

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``forward(hidden)`` without the logits (int64 [rows]), where the packed
        quantized table's kernel gives it; None: compute the logits."""
        return None if self.quantized is None else self.quantized.argmax(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(hidden, out_dtype=torch.float32)
        if self.packed is not None:
            return self.packed(hidden).float()
        if hidden.dtype == torch.bfloat16 and not native_bf16_supported():
            return F.linear(hidden.float(), self.weight.float())  # see linear._upcast_linear
        return F.linear(hidden, self.weight).float()
