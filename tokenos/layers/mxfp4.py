"""MXFP4 (OCP microscaling FP4), the format gpt-oss releases its experts in, dequantized at load.

A row of K values is stored as K / 32 blocks: ``blocks [..., K / 32, 16]`` uint8 holds two FP4 (e2m1)
codes per byte (low nibble the even element, high nibble the odd one), ``scales [..., K / 32]`` uint8 one
e8m0 exponent per block (value ``2 ** (scale - 127)``). Every FP4 value times a power of two is exact in
bf16 and float32, so dequantizing is lossless in either dtype. No kernel here computes on MXFP4 directly.
"""

from __future__ import annotations

import torch

# The 16 e2m1 values by code: sign bit 3, then exponent 2 bits and mantissa 1 bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``blocks [..., G, 16]`` and ``scales [..., G]`` -> ``[..., G * 32]`` values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks / scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"([..., G, {BLOCK // 2}] and [..., G])"
        )
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], even first
    values = torch.ldexp(table[codes.long()], scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS)
    return values.flatten(-2).to(dtype)
