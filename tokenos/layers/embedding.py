"""Token embedding and the LM head; a tied head reuses the embedding's weight parameter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.linear import PackedWeight, packing_enabled
from tokenos.platform import native_bf16_supported


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> float32 logits. ``tied_to`` shares the embedding's weight instead of owning one."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.tied = tied_to is not None
        self.packed: PackedWeight | None = None

    def pack(self) -> None:
        """Compute from a oneDNN-packed copy (see `tokenos.layers.linear`); a tied head keeps the
        embedding's plain weight for the lookup, an untied one drops its own."""
        if self.packed is None and packing_enabled():
            self.packed = PackedWeight(self.weight.detach())
            if not self.tied:
                self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(hidden).float()
        if hidden.dtype == torch.bfloat16 and not native_bf16_supported():
            return F.linear(hidden.float(), self.weight.float())  # see linear._upcast_linear
        return F.linear(hidden, self.weight).float()
