"""Small C kernels for the CPU hot paths, compiled on first use and loaded with ctypes.

Decode attention (csrc/paged_attention.c) and, on CPUs with AVX512-BF16, prefill attention
(csrc/prefill_attention.c) read K/V in place from the paged cache; the step ops
(csrc/step_ops.c) fuse residual add + RMSNorm, SiLU-and-mul and rotary, each a handful of eager
torch ops whose dispatch overhead dominates at decode sizes. One library is built per source
version and CPU with the system C compiler (`cc -O3 -march=native -fopenmp`) into
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
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "paged_attention.c",
        "prefill_attention.c",
        "step_ops.c",
        "qlinear.c",
        "lora.c",
        "decode_layer.c",
        "packed_prefix.c",
        "argmax.c",
    )
)
_HEADERS = (_CSRC / "vec_math.h", _CSRC / "amx.h", _CSRC / "packed_prefix.h", _CSRC / "argmax.h")
MAX_HEAD_SIZE = 512  # MAX_HEAD in the C source
_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "paged_decode": [_P, _P, _I64, _I, _P, _I, _P, _I, _I, _I, _I, _F, _I, _P, _F, _P, _P],
    "rms_norm": [_P, _P, _P, _P, _P, _I64, _I, _F],
    "silu_and_mul": [_P, _P, _I64, _I],
    "rotary": [_P, _I64, _I, _P, _I64, _I, _I, _I, _P, _P, _I64],
    "kv_write_int8": [_P, _I64, _P, _I64, _I64, _I, _P, _P, _F, _F],
    "kv_write_fp8": [_P, _I64, _P, _I64, _I64, _I, _P, _P, _F, _F],
    "decode_layers": [_P, _P, _I, _P, _P],
}
_PREFILL_SIGNATURE = [_P, _I64, _P, _I, _I64, _I, _P, _I, _P, _I, _I, _I, _I, _F, _I, _P, _I64, _F, _P, _P]
_QLINEAR_SIGNATURES = {
    "qgemm_bf16_desc": [_P, _P, _I64, _I64, _P, _I64, _I],
    "qgemm_f32_desc": [_P, _P, _I64, _I64, _P, _I64],
    "qdequant_f32_desc": [_P, _I64, _I64, _P],
    "qgemm_bf16_argmax_desc": [_P, _P, _I64, _I64, _P],
    "qrows_desc": [_P, _P, _I64, _P, _I],
}


class LoRAPiece(ctypes.Structure):
    """csrc/lora.c's ``lora_piece``: one adapted shard's output columns, its rows of t, its scaled B^T."""

    _fields_ = [
        ("offset", ctypes.c_int64),
        ("size", ctypes.c_int64),
        ("r0", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("bt", ctypes.c_void_p),
    ]


class LoRADesc(ctypes.Structure):
    """csrc/lora.c's ``lora_desc``: one adapter on one linear (A [rank, K] and up to three pieces)."""

    _fields_ = [
        ("a", ctypes.c_void_p),
        ("rank", ctypes.c_int32),
        ("num_pieces", ctypes.c_int32),
        ("K", ctypes.c_int64),
        ("pieces", LoRAPiece * 3),
    ]


class QDesc(ctypes.Structure):
    """csrc/qlinear.c's ``qdesc``: a packed weight, described once."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("s", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
    ]


# The dtypes the kernels are written for: tensors of other dtypes take the torch path.
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _cache_dir() -> Path:
    return Path(os.environ.get("TOKENOS_CACHE_DIR", Path.home() / ".cache" / "tokenos" / "kernels"))


# Not -ffast-math: linking with it sets flush-to-zero for the whole process when the library loads,
# which would change every float computation after it. These allow the vectorized reductions alone.
# -falign-loops=32: every loop starts on a 32-byte fetch block, so a hot loop's speed no longer moves
# with an edit elsewhere in the library (adding cascade code to paged_attention.c, which shifts qlinear.c,
# made the one-row fp32 GEMV 1.23x slower on a Zen 3: 130 -> 160 us, the two builds alternated in one
# process; with the flag 71 against 72 us; 64-byte alignment measured 1.3x slower).
# TOKENOS_KERNEL_MARCH builds for an older ISA than this CPU's (x86-64-v3: AVX2 only), so that
# one machine can test the code paths another CPU takes.
CFLAGS = (
    "-O3",
    f"-march={os.environ.get('TOKENOS_KERNEL_MARCH', 'native')}",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-falign-loops=32",
    "-fopenmp",
    "-shared",
    "-fPIC",
)


def _build(sources: tuple[Path, ...], out: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *CFLAGS, *map(str, sources), "-o", str(tmp_out), "-lm"]
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
    source = b"".join(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
    source += " ".join(CFLAGS).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(source).hexdigest()[:16]
    lib_path = _cache_dir() / f"tokenos_kernels_{digest}.so"
    try:
        if not lib_path.exists():
            _build(_SOURCES, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("C kernels unavailable (%s); using the torch paths", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        for suffix in DTYPES.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None
    # fp8 (e4m3fn) and int8 KV pages: decode only, so not in DTYPES (the step ops have no 8-bit variant).
    for fn in (lib.paged_decode_fp8, lib.paged_decode_int8):
        fn.argtypes = _SIGNATURES["paged_decode"]
        fn.restype = None
    lib.paged_prefill_bf16.argtypes = _PREFILL_SIGNATURE
    lib.paged_prefill_bf16.restype = None
    lib.paged_prefill_supports.argtypes = [_I, _I, _I]
    lib.paged_prefill_available.argtypes = []
    lib.qlinear_available.argtypes = []
    lib.kernels_amx_ready.argtypes = []
    lib.kernels_set_amx.argtypes = [_I]
    lib.kernels_set_amx.restype = None
    lib.kernels_set_amx(0 if os.environ.get("TOKENOS_DISABLE_AMX") == "1" else 1)
    lib.kernels_set_batch_invariant.argtypes = [_I]
    lib.kernels_set_batch_invariant.restype = None
    lib.kernels_batch_invariant.argtypes = []
    lib.kernels_set_batch_invariant(1 if os.environ.get("TOKENOS_BATCH_INVARIANT") == "1" else 0)
    lib.paged_decode_set_cascade.argtypes = [_I]
    lib.paged_decode_set_cascade.restype = None
    lib.paged_decode_cascade_on.argtypes = []
    lib.paged_decode_avx2_cascade.argtypes = []
    lib.paged_decode_last_groups.argtypes = []
    lib.paged_decode_set_cascade(0 if os.environ.get("TOKENOS_DISABLE_CASCADE_ATTN") == "1" else 1)
    lib.cascade_cache_stats.argtypes = [_P]
    lib.cascade_cache_stats.restype = None
    lib.cascade_cache_clear.argtypes = []
    lib.cascade_cache_clear.restype = None
    lib.cascade_cache_set_limit.argtypes = [_I64]
    lib.cascade_cache_set_limit.restype = None
    for name, argtypes in _QLINEAR_SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    for suffix in DTYPES.values():
        getattr(lib, f"lora_apply_{suffix}").argtypes = [_P, _I64, _P, _I64, _I, _P, _P, _P]
        getattr(lib, f"lora_apply_{suffix}").restype = None
    lib.lora_max_rank.argtypes = []
    lib.argmax_rows_f32.argtypes = [_P, _I64, _I64, _I64, _P]
    lib.argmax_rows_f32.restype = None
    return lib


@cache  # asked by every adapted linear every step
def lora_kernel(dtype: torch.dtype):
    """csrc/lora.c's ``lora_apply_*`` for tensors of ``dtype`` (x, x's row stride, y, y's row stride,
    the number of segments, their int64 starts and ends, one `LoRADesc` address or NULL each), or None
    without the library; and the most t entries it takes."""
    lib = load()
    if lib is None or dtype not in DTYPES:
        return None, 0
    return getattr(lib, f"lora_apply_{DTYPES[dtype]}"), lib.lora_max_rank()


@cache
def qgemm_kernel(dtype: torch.dtype):
    """csrc/qlinear.c's ``qgemm_*_desc`` for activations in ``dtype`` (called with a `QDesc` address
    first), or None where the library or this CPU lacks it (fp32: AVX2 + FMA + F16C; bf16:
    AVX512-BF16)."""
    lib = load()
    if lib is None or dtype not in DTYPES:
        return None
    bit = 2 if dtype == torch.bfloat16 else 1
    return getattr(lib, f"qgemm_{DTYPES[dtype]}_desc") if lib.qlinear_available() & bit else None


@cache
def qargmax_kernel():
    """csrc/qlinear.c's ``qgemm_bf16_argmax_desc`` (a `QDesc` address, bf16 x, its rows, its row stride,
    an int64 [rows] out): each row's argmax of the float32 products, none stored; None where the bf16
    kernels are not built."""
    lib = load()
    return lib.qgemm_bf16_argmax_desc if lib is not None and lib.qlinear_available() & 2 else None


@cache
def qdequant_kernel():
    """csrc/qlinear.c's ``qdequant_f32_desc`` (a `QDesc` address, rows n0..n1, a dense fp32 [n1 - n0, K]
    out), or None where the fp32 kernels are not built."""
    lib = load()
    return lib.qdequant_f32_desc if lib is not None and lib.qlinear_available() & 1 else None


@cache
def qrows_kernel():
    """csrc/qlinear.c's ``qrows_desc`` (a `QDesc` address, int64 row ids, their count, an [n, K] out, 1
    for bf16 else float32): rows of the weight dequantized, an embedding lookup, returning 1 where an id
    is not a row; None where the fp32 kernels are not built."""
    lib = load()
    if lib is None or not lib.qlinear_available() & 1:
        return None
    lib.qrows_desc.restype = ctypes.c_int  # 1: an id out of range, nothing written
    return lib.qrows_desc


def _library_call(name: str, *args: int) -> Any:
    """``lib.name(*args)`` where the library is loaded, else None: the process switches below."""
    lib = load()
    return None if lib is None else getattr(lib, name)(*args)


def uses_amx() -> bool:
    """Whether the kernels multiply on AMX tiles where they have a tile path (csrc/qlinear.c's exact
    few-row path, 2 to 16 rows, and panel path, more, for bf16 quantized linears;
    csrc/prefill_attention.c's two products): an AMX-BF16 CPU, a kernel built for it, the kernel
    allowed to use it by the OS, and not ``TOKENOS_DISABLE_AMX=1``."""
    return bool(_library_call("kernels_amx_ready"))


def set_amx(on: bool) -> None:
    """Allow or forbid the AMX tile paths for this process (the tests compare them with the AVX-512 ones)."""
    _library_call("kernels_set_amx", int(on))


def batch_invariant() -> bool:
    """Whether the kernels run batch-invariant (``TOKENOS_BATCH_INVARIANT=1``, or `set_batch_invariant`):
    a quantized linear's row, and a decode's attention, come out the same bits whatever else shares the
    call (see csrc/qlinear.c and csrc/paged_attention.c), at some cost in speed; greedy speculative
    decoding then gives the tokens plain decoding gives."""
    return bool(_library_call("kernels_batch_invariant"))


def set_batch_invariant(on: bool) -> None:
    """Turn batch invariance on or off for this process (see `batch_invariant`)."""
    _library_call("kernels_set_batch_invariant", int(on))


def set_cascade(on: bool) -> None:
    """Allow or forbid cascade attention for decodes sharing cached pages (csrc/paged_attention.c's
    find_shared) in this process; ``TOKENOS_DISABLE_CASCADE_ATTN=1`` starts with it off."""
    _library_call("paged_decode_set_cascade", int(on))


def cascade_cache_stats() -> dict[str, int]:
    """The packed-prefix cache of cascade attention (csrc/packed_prefix.c): entries, bytes, and
    the groups that found their prefix packed (hits), packed it anew (misses) or packed only the pages
    it had grown by (grown) since the last clear."""
    lib = load()
    out = (ctypes.c_int64 * 5)()
    if lib is not None:
        lib.cascade_cache_stats(out)
    return dict(zip(("entries", "bytes", "hits", "misses", "grown"), out, strict=True))


def clear_cascade_cache() -> None:
    """Free every packed prefix (an engine's shutdown; tests)."""
    _library_call("cascade_cache_clear")


def set_cascade_cache_limit(mib: int | None) -> None:
    """Bound the packed-prefix cache to ``mib`` MiB (0: keep nothing; None: ``TOKENOS_CASCADE_CACHE_MB``,
    default 256), dropping entries past it now."""
    _library_call("cascade_cache_set_limit", -1 if mib is None else mib << 20)


def uses_cascade(kv_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether decodes sharing cached pages of ``kv_dtype`` attend them once per group, with the switch
    on: on AVX2 through the decode kernel's own whole-request item (every page dtype), on AVX512-BF16
    through the prefill kernel's packed prefixes (bf16 pages; see `packs_prefixes`)."""
    lib = load()
    if lib is None or not lib.paged_decode_cascade_on() or lib.kernels_batch_invariant():
        return False  # batch invariance: a group's prefix would be summed apart from each member's tokens
    return bool(lib.paged_decode_avx2_cascade()) or (kv_dtype == torch.bfloat16 and packs_prefixes())


def cascaded_groups() -> int:
    """How many groups of requests the last decode-attention call attended their shared pages for once
    (0: no cascade); for tests."""
    lib = load()
    return int(lib.paged_decode_last_groups()) if lib is not None else 0


def packs_prefixes() -> bool:
    """Whether cascade attention over bf16 pages packs the shared prefixes (the AVX512-BF16 prefill
    kernel's layout, kept in the packed-prefix cache between calls)."""
    lib = load()
    return bool(lib is not None and lib.paged_prefill_available())


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the step-op kernels can take these tensors: CPU, one supported dtype, contiguous
    last dimension, not tracked by autograd, and the library built. Called several times per layer,
    so it is kept to attribute reads."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES or load() is None:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1:
            return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _fn(name: str, dtype: torch.dtype):
    return getattr(load(), f"{name}_{DTYPES[dtype]}")


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax of float32 ``x`` [rows, n] (int64 [rows]), the index ``x.max(dim=1).indices``
    gives (the first maximum; a row's first NaN where it has one); None where the kernel does not
    apply (no C kernels, another dtype or layout), for the caller's torch path."""
    lib = load()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """norm(x + residual) and the new residual x + residual (None without one); see step_ops.c."""
    x = x.contiguous()
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    new_residual = None
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    _fn("rms_norm", x.dtype)(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if new_residual is None else new_residual.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
    )
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of width 2d; see step_ops.c."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], d)
    _fn("silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (NeoX halves of the first rotary_dim) by
    this step's cos / sin (contiguous [T, ..., rotary_dim / 2], in q's dtype)."""
    _fn("rotary", q.dtype)(
        q.data_ptr(),
        q.stride(0),
        q.shape[1],
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        q.shape[2],
        rotary_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        q.shape[0],
    )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    page_epochs: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, D] float32; kv_cache [num_blocks, 2, bs, KVH, D] pages (float32, bf16, fp8 e4m3fn or int8);
    -> [n, H, D] float32. The cache holds K / k_scale and V / v_scale: scores are linear in K and
    outputs in V, so the scales fold into the softmax scale and one multiply of the output (the soft cap
    applies to the scaled score, so it is unaffected). ``softcap``: cap * tanh(score / cap) (None: off);
    ``sinks`` [H]: a logit per query head joining its softmax sum with no value (None: none).
    ``page_epochs``: int64 [num_blocks], see tokenos/worker/kv_cache.py `PageEpochs`; given, cascade
    attention keeps the packed prefixes of decode groups between calls (None: packs them every call)."""
    sinks = _sinks_arg(sinks, q.shape[1])
    assert page_epochs is None or (page_epochs.dtype == torch.int64 and page_epochs.is_contiguous())
    lib = load()
    assert lib is not None
    n, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    fn = {
        torch.bfloat16: lib.paged_decode_bf16,
        torch.float8_e4m3fn: lib.paged_decode_fp8,
        torch.int8: lib.paged_decode_int8,
    }.get(kv_cache.dtype, lib.paged_decode_f32)
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
        scale * k_scale,
        window or 0,
        out.data_ptr(),
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        None if page_epochs is None else page_epochs.data_ptr(),
    )
    return out if v_scale == 1.0 else out.mul_(v_scale)


def _sinks_arg(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Sinks as the kernels read them: num_heads contiguous float32 logits (kept alive by the caller's
    reference for the call)."""
    if sinks is None:
        return None
    sinks = sinks.detach().reshape(-1).to(torch.float32).contiguous()
    if sinks.numel() != num_heads:
        raise ValueError(f"{sinks.numel()} sinks for {num_heads} query heads")
    return sinks


def kv_write_8bit(
    k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, rows: torch.Tensor, k_scale: float, v_scale: float
) -> None:
    """Write K / k_scale and V / v_scale into 8-bit pages as attention.py's torch path writes them (int8:
    rounded half to even, clamped to [-127, 127]; float8 e4m3fn: clamped to +-448, converted as torch
    converts): k and v [n, KVH, D] float32 or bf16 with contiguous rows (any token stride); flat the pages
    as rows [*, KVH, D] of whole-row stride, int8 or float8_e4m3fn; rows int64 [2n], K's rows then V's.
    See paged_attention.c."""
    n, num_kv_heads, head_size = k.shape
    _fn("kv_write_fp8" if flat.dtype == torch.float8_e4m3fn else "kv_write_int8", k.dtype)(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        n,
        num_kv_heads * head_size,
        flat.data_ptr(),
        rows.data_ptr(),
        *kv_write_scales(flat.dtype, k_scale, v_scale),
    )


def kv_write_scales(dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    """What the C 8-bit write of pages of ``dtype`` takes for K and V: fp8 divides by the scales, int8
    multiplies by their reciprocals (as `attention.quantize_int8` does), each rounded once to float32 by
    the caller's ctypes argument or field."""
    if dtype == torch.float8_e4m3fn:
        return k_scale, v_scale
    return 1.0 / k_scale, 1.0 / v_scale


@cache  # asked by every attention layer every step; the library and the CPU do not change
def prefill_supported(num_heads: int, num_kv_heads: int, head_size: int) -> bool:
    """Whether the C prefill kernel is built for this CPU (AVX512-BF16) and takes these head shapes."""
    lib = load()
    return (
        lib is not None
        and bool(lib.paged_prefill_available())
        and bool(lib.paged_prefill_supports(num_heads, num_kv_heads, head_size))
    )


# prefill_attention.c's kv_kind: how the pack phase reads a page element.
_PREFILL_KV_KINDS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.int8: 2}


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    chunks: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    page_epochs: torch.Tensor | None = None,
) -> None:
    """Every prefill chunk of a step at once, bf16 queries over bf16, float8 e4m3fn or int8 pages, read in
    place; see prefill_attention.c. q and out [T, H, D] (heads contiguous, any token stride); chunks int32
    [n, 3] = (first token, query length, cached tokens before it); block_table int32 [n, max_blocks].
    ``softcap`` and ``sinks`` as in `paged_decode`. ``page_epochs`` as in `paged_decode`: given, a cached
    prefix that chunks share, or that the packed-prefix cache holds, is read from there (the same
    arithmetic as packing it with each chunk)."""
    assert page_epochs is None or (page_epochs.dtype == torch.int64 and page_epochs.is_contiguous())
    sinks = _sinks_arg(sinks, q.shape[1])
    lib = load()
    assert lib is not None
    _, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    lib.paged_prefill_bf16(
        q.data_ptr(),
        q.stride(0),
        kv_cache.data_ptr(),
        _PREFILL_KV_KINDS[kv_cache.dtype],
        kv_cache.stride(0),
        block_size,
        block_table.data_ptr(),
        block_table.shape[1],
        chunks.data_ptr(),
        chunks.shape[0],
        num_heads,
        num_kv_heads,
        head_size,
        scale,
        window or 0,
        out.data_ptr(),
        out.stride(0),
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        None if page_epochs is None else page_epochs.data_ptr(),
    )
