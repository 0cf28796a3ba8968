"""What this machine can do, and the dtype names every layer shares: one small module at the bottom.

Layers, models and the worker all ask the same two questions: "does this CPU run bfloat16 matmuls
natively?" and "which torch dtype does this name mean?". Both answers live here, below every package
that needs them, so no layer reaches up into the model code for a CPU probe. The probe is cached: it
is asked on every bf16 matmul.
"""

from __future__ import annotations

import functools

import torch

# Names users and configs write -> torch dtypes (the KV-cache specs use the canonical names only).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (`float32`, `bfloat16`, `float16` or an alias); ValueError if none."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"Unknown dtype {name!r}; use one of {', '.join(TORCH_DTYPES)}.") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch dtype ("float32", "bfloat16"), as KV-cache specs write it."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def native_bf16_supported() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (AVX512-BF16 / AMX); otherwise bf16 is emulated
    and several times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
