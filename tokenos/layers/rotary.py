"""Rotary position embedding (HF rotate-half layout) with the rope scalings of transformers'
``ROPE_INIT_FUNCTIONS``: default, linear, llama3, yarn, longrope and dynamic (NTK).

cos/sin for every position up to max_position are computed once in float32 (the same
products transformers computes per step), multiplied by the type's attention factor (yarn's and
longrope's mscale; 1 otherwise) as transformers multiplies its cos and sin, then gathered by
``positions`` once per step (``cos_sin``) and shared by every attention layer (``Rope``). Scaling the
table is all the attention factor needs: the C kernel and ``_rotate`` read cos / sin as given.
``rotary_dim < head_dim`` rotates only the first ``rotary_dim`` dims of each head (partial rotary:
Bamba, Qwen3-Next, Falcon-H1, Phi-3); ``NoRotary`` is the identity for attention without positions
(NemotronH, Granite "nope"). Where the C kernels are built, q and k (views into the qkv projection's
output) are rotated in place in one pass (csrc/step_ops.c), rounding as ``_rotate`` does; ``_rotate``
is the reference and fallback.

Length-dependent types. transformers' longrope and dynamic pick their frequencies from the length of
the forward's longest sequence (``dynamic_rope_update``): longrope uses ``long_factor`` for every position
of a forward once ``max(position_ids) + 1 > original_max_position_embeddings`` (else ``short_factor``);
dynamic recomputes its NTK base for ``seq_len = max(position_ids) + 1`` once that exceeds
``max_position_embeddings``. Our table is one per model, so each position ``p`` gets the frequencies
transformers gives a forward whose longest sequence is ``p + 1``: short factors (dynamic: the original
base) below the boundary, long factors (dynamic: the base grown for ``p + 1``) from it on. That is

- exact for every sequence that stays within the boundary (the usual case, and every sequence when
  ``max_model_len`` is set to at most the original length);
- exact, beyond it, against transformers run one token at a time through its KV cache, which is what its
  ``generate`` does for Llama / Qwen / Mistral-style models (longrope or dynamic) whose prompt fits within
  the boundary: each decode step is a forward of length ``p + 1``;
- different where transformers rotates positions on both sides of the boundary in one forward: a prompt
  longer than the boundary (transformers: long factors / the full length's base for all its positions,
  the early ones included), and Phi-3's ``generate``, which at the crossing drops its cache and recomputes
  the whole sequence with long factors (``Phi3ForCausalLM.prepare_inputs_for_generation``), so for it any
  sequence past ``original_max_position_embeddings`` is long-rotated throughout. We keep one rotation per
  position instead: a per-forward switch would make a token's cached key depend on how the scheduler
  chunked its prefill or batched it, break prefix-cache reuse between short and long requests, and need a
  recompute of every cached key at the crossing, which the engine does not do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenos.layers import cpu_kernels

# The fields each scaling type must name (after `tokenos.models.config` has filled in what transformers
# derives: original_max_position_embeddings, a yarn / longrope factor, dynamic's max_position_embeddings).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "max_position_embeddings"),
}


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The scaling's type, checked supported and complete: a missing field is refused by name rather than
    silently rotating with the wrong frequencies."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in REQUIRED_FIELDS:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(REQUIRED_FIELDS)}")
    missing = [f for f in REQUIRED_FIELDS[rope_type] if (scaling or {}).get(f) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs rope_parameters field(s) {', '.join(missing)}")
    return rope_type


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


def _yarn_correction_range(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[float, float]:
    """The dims whose wavelengths fit ``beta_fast`` .. ``beta_slow`` turns in the original context."""
    old_len = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    # transformers treats 0 / None as unset (`or`), so do we.
    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by ``factor`` (interpolated), a linear
    ramp over the dims between; the expressions are transformers' so the float32 rounding is too."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling["factor"] * pos_freqs)
    low, high = _yarn_correction_range(dim, theta, scaling)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope_inv_freq(dim: int, theta: float, scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own rescale factor, short or long."""
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != dim // 2:
        which = "long_factor" if long else "short_factor"
        raise ValueError(f"longrope {which} has {len(factors)} entries; rotary dim {dim} needs {dim // 2}")
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _dynamic_inv_freq(dim: int, theta: float, scaling: dict[str, Any], seq_len: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: the base grown for ``seq_len`` [N] (int64) past max_position_embeddings, one row of
    frequencies per length [N, dim / 2], in transformers' float32 tensor arithmetic."""
    factor, max_len = scaling["factor"], scaling["max_position_embeddings"]
    seq_len = torch.maximum(seq_len, torch.tensor(max_len, dtype=seq_len.dtype))
    base = theta * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base[:, None] ** exponents)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, seq_len: int | None = None
) -> torch.Tensor:
    """transformers' inverse frequencies [head_dim / 2] of ``scaling`` for a forward whose longest sequence
    is ``seq_len`` (None: at init). Only longrope and dynamic depend on ``seq_len``."""
    rope_type = rope_type_of(scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        return _longrope_inv_freq(head_dim, theta, scaling, long)
    if rope_type == "dynamic":
        if seq_len is not None and seq_len > scaling["max_position_embeddings"]:
            return _dynamic_inv_freq(head_dim, theta, scaling, torch.tensor([seq_len]))[0]
        # At init transformers runs the same formula in Python floats for seq_len = max_position_embeddings:
        # a base of theta * ~1, not always exactly theta, so it is repeated rather than assumed.
        factor, max_len = scaling["factor"], scaling["max_position_embeddings"]
        base = theta * ((factor * max_len / max_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _inv_freq(head_dim, base)
    inv_freq = _inv_freq(head_dim, theta)
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    return inv_freq


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What transformers multiplies cos and sin by: the config's ``attention_factor`` if set, else yarn's
    mscale (DeepSeek's ``mscale`` / ``mscale_all_dim`` ratio when both are set) or longrope's
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``; 1 for the other types."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def rope_angles(
    rotary_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """The rotation angle of every position and frequency [max_position, rotary_dim / 2] in float32;
    longrope and dynamic give position p the frequencies of a forward of length p + 1 (module docstring)."""
    positions = torch.arange(max_position, dtype=torch.float32)
    rope_type = rope_type_of(scaling)
    boundary = {"longrope": "original_max_position_embeddings", "dynamic": "max_position_embeddings"}
    if rope_type not in boundary or max_position <= scaling[boundary[rope_type]]:
        return torch.outer(positions, rope_inv_freq(rotary_dim, theta, scaling))
    split = scaling[boundary[rope_type]]
    inside = torch.outer(positions[:split], rope_inv_freq(rotary_dim, theta, scaling))
    if rope_type == "longrope":
        beyond = torch.outer(positions[split:], rope_inv_freq(rotary_dim, theta, scaling, seq_len=split + 1))
    else:
        lengths = torch.arange(split + 1, max_position + 1, dtype=torch.int64)
        beyond = positions[split:, None] * _dynamic_inv_freq(rotary_dim, theta, scaling, lengths)
    return torch.cat((inside, beyond))


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
        freqs = rope_angles(self.rotary_dim, max_position, theta, scaling)
        # transformers scales cos and sin (not q or k), in float32 before casting to the compute dtype.
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos_cache", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * factor, persistent=False)

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
