"""Rotary position embedding (HF rotate-half layout) with default, linear and llama3 scaling.

cos/sin for every position up to max_position are computed once in float32 (the same
products transformers computes per step), then gathered by ``positions`` once per step (``cos_sin``)
and shared by every attention layer (``Rope``). ``rotary_dim < head_dim`` rotates only the first
``rotary_dim`` dims of each head (partial rotary: Bamba, Qwen3-Next, Falcon-H1); ``NoRotary`` is the
identity for attention without positions (NemotronH, Granite "nope"). Where the C kernels are built,
q and k (views into the qkv projection's output) are rotated in place in one pass (csrc/step_ops.c),
rounding as ``_rotate`` does; ``_rotate`` is the reference and fallback.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenos.layers import cpu_kernels


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, a smooth blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "default":
        raise ValueError(f"Unsupported rope_type {rope_type!r}")
    return inv_freq


# This step's (cos, sin) [T, 1, rotary_dim / 2], gathered once and shared by every layer.
Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """RoPE for q [T, H, D] and k [T, KVH, D]; ``cos_sin(positions)`` once per step, then
    ``forward(cos_sin, q, k)`` in every layer. Only the first ``rotary_dim`` dims (default: all) turn."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        freqs = torch.outer(
            torch.arange(max_position, dtype=torch.float32), rope_inv_freq(self.rotary_dim, theta, scaling)
        )
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin [T, 1, rotary_dim / 2] at ``positions`` [T], in ``dtype``."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        return cos, self.sin_cache[positions].unsqueeze(1).to(dtype)

    def forward(self, rope: Rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        d = self.rotary_dim
        if _rotate_in_place(q, k, cos, sin):
            cpu_kernels.rotary_(q, k, cos, sin, d)
            return q, k
        if d == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        q_rot, k_rot = _rotate(q[..., :d], cos, sin), _rotate(k[..., :d], cos, sin)
        return torch.cat((q_rot, q[..., d:]), -1), torch.cat((k_rot, k[..., d:]), -1)


class NoRotary(nn.Module):
    """Attention without rotary: q and k pass through (the step's rope is None)."""

    def forward(self, rope: None, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def _rotate_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the C kernel takes these: heads contiguous within a token, this step's cos / sin
    contiguous in q's dtype."""
    heads_packed = q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]
    return heads_packed and cos.is_contiguous() and sin.is_contiguous() and cpu_kernels.usable(q, k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
