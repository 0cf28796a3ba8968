"""Small C kernels for the CPU hot paths, compiled on first use and loaded with ctypes.

Only decode attention lives here: reading K/V in place from the paged cache beats
gathering it into padded tensors for SDPA. The library is built once per source version
with the system C compiler (`cc -O3 -march=native -fopenmp`) into
`$TOKENOS_CACHE_DIR` (default `~/.cache/tokenos/kernels`). Without a compiler (or with
`TOKENOS_DISABLE_C_KERNELS=1`) `load()` returns None and callers use the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "paged_attention.c"
MAX_HEAD_SIZE = 512  # MAX_HEAD in the C source
_P = ctypes.c_void_p
_I = ctypes.c_int
_ARGTYPES = [_P, _P, ctypes.c_int64, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_float, _I, _P]


def _cache_dir() -> Path:
    return Path(os.environ.get("TOKENOS_CACHE_DIR", Path.home() / ".cache" / "tokenos" / "kernels"))


# Not -ffast-math: linking with it sets flush-to-zero for the whole process when the library loads,
# which would change every float computation after it. These allow the vectorized reductions alone.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fopenmp",
    "-shared",
    "-fPIC",
)


def _build(src: Path, out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *CFLAGS, str(src), "-o", str(tmp_out), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor()


@cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("TOKENOS_DISABLE_C_KERNELS") == "1":
        return None
    # -march=native: a library is valid for this CPU only, so the CPU's flags are part of its key.
    source = _SRC.read_bytes() + " ".join(CFLAGS).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(source).hexdigest()[:16]
    lib_path = _cache_dir() / f"paged_attention_{digest}.so"
    try:
        if not lib_path.exists():
            _build(_SRC, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("C attention kernel unavailable (%s); using the torch path", e)
        return None
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = _ARGTYPES
        fn.restype = None
    return lib


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [n, H, D] float32; kv_cache [num_blocks, 2, bs, KVH, D] pages; -> [n, H, D] float32."""
    lib = load()
    assert lib is not None
    n, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    fn = lib.paged_decode_bf16 if kv_cache.dtype == torch.bfloat16 else lib.paged_decode_f32
    fn(
        q.data_ptr(),
        kv_cache.data_ptr(),
        kv_cache.stride(0),
        block_size,
        block_table.data_ptr(),
        block_table.shape[1],
        seq_lens.data_ptr(),
        n,
        num_heads,
        num_kv_heads,
        head_size,
        scale,
        window or 0,
        out.data_ptr(),
    )
    return out
