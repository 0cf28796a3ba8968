"""What this machine can do, and the dtype names every layer shares: one small module at the bottom.

Layers, models and the worker all ask the same two questions: "does this CPU run bfloat16 matmuls
natively?" and "which torch dtype does this name mean?". Both answers live here, below every package
that needs them, so no layer reaches up into the model code for a CPU probe. The probe is cached: it
is asked on every bf16 matmul.
"""

from __future__ import annotations

import functools

import torch

from tokenos.config import KV_CACHE_DTYPES

# Names users and configs write -> torch dtypes (the KV-cache specs use the canonical names only).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    # KV-cache pages only (--kv-cache-dtype fp8 / fp8_e4m3 / int8): no layer computes in them.
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
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


def kv_cache_dtype_name(cache_dtype: str, model_dtype: str) -> str:
    """The spec dtype name of attention pages for ``--kv-cache-dtype cache_dtype`` under a model
    computing in ``model_dtype`` (a canonical name); ValueError naming the choices if unknown."""
    try:
        name = KV_CACHE_DTYPES[cache_dtype]
    except KeyError:
        raise ValueError(
            f"Unknown kv_cache_dtype {cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}."
        ) from None
    return model_dtype if name is None else name


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether pages of this dtype hold float8 e4m3 values (stored scaled, read back times a scale)."""
    return dtype == torch.float8_e4m3fn


def is_scaled_kv(dtype: torch.dtype) -> bool:
    """Whether attention pages of this dtype hold K / k_scale and V / v_scale (fp8 e4m3 or int8), so
    every reader multiplies by the layer's scales."""
    return dtype in (torch.float8_e4m3fn, torch.int8)


@functools.cache
def native_bf16_supported() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (AVX512-BF16 / AMX); otherwise bf16 is emulated
    and several times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def configure_threads() -> int:
    """Set torch's intra-op thread count for the cores this process may use, and return it.

    ``TOKENOS_NUM_THREADS`` wins; with ``OMP_NUM_THREADS`` set torch already obeys it. Otherwise
    torch starts one thread per physical core of the whole machine, which oversubscribes a process
    pinned (taskset, cgroup cpuset) to fewer cores: cap it at the cores in the affinity mask."""
    import os

    wanted = os.environ.get("TOKENOS_NUM_THREADS")
    if wanted:
        torch.set_num_threads(max(1, int(wanted)))
    elif not os.environ.get("OMP_NUM_THREADS") and hasattr(os, "sched_getaffinity"):
        allowed = len(os.sched_getaffinity(0))
        if allowed < torch.get_num_threads():
            torch.set_num_threads(allowed)
    return torch.get_num_threads()


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and its feature flags, from /proc/cpuinfo."""
    model, flags = "unknown CPU", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_summary() -> str:
    """The CPU's model name and the vector / matrix extensions the kernels use, for start-up logs."""
    model, flags = cpu_info()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{model} [{' '.join(f for f in wanted if f in flags) or 'no AVX2'}]"
