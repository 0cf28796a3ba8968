"""Pre-quantized Hugging Face GPTQ and AWQ int4 checkpoints, mapped into `QuantizedTensor`s.

Both store a linear as int32 words of eight 4-bit values plus fp16 group scales; they differ in which
axis is packed and in what order (the layouts of AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's
``WQLinear_GEMM.from_linear``):

- GPTQ: ``qweight`` [K / 8, N] packed along K (value i of word r is bits 4i..4i+3, k = 8r + i);
  ``qzeros`` [K / G, N / 8] packed along N the same way; ``scales`` [K / G, N]; ``g_idx`` [K] the group
  of each input column; ``w = scales * (q - zero)``. Checkpoint format "gptq" (v1, AutoGPTQ) stores
  ``zero - 1``, "gptq_v2" the zero itself.
- AWQ (GEMM): ``qweight`` [K, N / 8] packed along N, word c's value i holding column
  ``8c + AWQ_ORDER[i]``; ``qzeros`` [K / G, N / 8] likewise; ``scales`` [K / G, N];
  ``w = (q - zero) * scales``.

Either is exactly ``q * s + z`` with ``z = -s * zero`` (held in float; packing rounds it to fp16, the
accepted rounding). Act-order GPTQ (a permuted ``g_idx``) has no such form and is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenos.layers.quantization import QuantizedTensor

PREQUANTIZED_METHODS = ("gptq", "awq")
# AutoAWQ's GEMM packing: value i of a word holds column AWQ_ORDER[i] of its 8; the inverse permutation.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to the stored zeros
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class PrequantizedConfig:
    """What unpacking needs from ``quantization_config``."""

    method: str  # "gptq" or "awq" (4 bits: parse_quantization_config refuses others)
    group_size: int  # -1: one group per row
    zero_offset: int  # added to the stored zeros: 1 for GPTQ v1, else 0

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size


def parse_quantization_config(qc: dict[str, Any]) -> PrequantizedConfig:
    """Validate a checkpoint's ``quantization_config`` (gptq or awq), so an unsupported variant fails
    at config time with its name rather than as garbage weights."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in PREQUANTIZED_METHODS:
        raise ValueError(f"quant_method {method!r} is not one of {', '.join(PREQUANTIZED_METHODS)}")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with bits={bits} are not supported; only 4-bit ones are")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"{method}: group_size={group_size} is invalid")
    if method == "gptq":
        return _gptq_config(qc, group_size)
    return _awq_config(qc, group_size)


def _gptq_config(qc: dict[str, Any], group_size: int) -> PrequantizedConfig:
    # "format" is GPTQModel's alias; the old AutoGPTQ Marlin repack says so with a flag of its own.
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(
            f"gptq checkpoint_format {fmt!r} is not supported; choose one of {', '.join(_GPTQ_FORMATS)}"
        )
    # desc_act alone is harmless: only a permuted g_idx (checked per tensor) has no group-wise form.
    return PrequantizedConfig("gptq", group_size, _GPTQ_FORMATS[fmt])


def _awq_config(qc: dict[str, Any], group_size: int) -> PrequantizedConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not supported; only the GEMM layout is")
    if not qc.get("zero_point", True):
        raise ValueError("awq checkpoints without zero points (zero_point=false) are not supported")
    return PrequantizedConfig("awq", group_size, 0)


def read_quantization_config(folder: str) -> PrequantizedConfig:
    """The parsed ``quantization_config`` of a Hugging Face folder's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    return parse_quantization_config(qc)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their 4-bit values [..., W, 8], value i = bits 4i..4i+3."""
    return (words.to(torch.int32)[..., None] >> _SHIFTS) & 15


def unpack_gptq_weight(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ [K / 8, N] words -> q [N, K] uint8 (packed along K)."""
    v = _nibbles(qweight.t())  # [N, K / 8, 8]: k = 8 * row + i
    return v.reshape(qweight.shape[1], -1).to(torch.uint8)


def unpack_gptq_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ [K / G, N / 8] words -> stored zeros [N, K / G] (packed along N, in order)."""
    return _nibbles(qzeros).reshape(qzeros.shape[0], -1).t()


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ [R, N / 8] words -> values [R, N] in column order (AWQ_ORDER undone)."""
    v = _nibbles(words)[..., list(AWQ_REVERSE_ORDER)]
    return v.reshape(words.shape[0], -1)


def gptq_tensor(
    cfg: PrequantizedConfig,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> QuantizedTensor:
    """One GPTQ linear as a `QuantizedTensor`."""
    q = unpack_gptq_weight(qweight)
    n, k = q.shape
    group = cfg.group(k)
    _check_g_idx(g_idx, k, group)
    zero = unpack_gptq_zeros(qzeros)[:n] + cfg.zero_offset
    return _tensor(q, scales.t(), zero, group)


def awq_tensor(
    cfg: PrequantizedConfig, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> QuantizedTensor:
    """One AWQ (GEMM) linear as a `QuantizedTensor`."""
    q = unpack_awq(qweight).t().to(torch.uint8)
    n, k = q.shape
    zero = unpack_awq(qzeros).t()[:n]
    return _tensor(q, scales.t(), zero, cfg.group(k))


def _tensor(q: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor, group: int) -> QuantizedTensor:
    """``(q - zero) * s`` as ``q * s + z``: z = -s * zero, kept in float."""
    n, k = q.shape
    expected = (n, k // group)
    if tuple(scales.shape) != expected or tuple(zero.shape) != expected:
        raise ValueError(
            f"scales {tuple(scales.shape)} / zeros {tuple(zero.shape)} do not match a [{n}, {k}] weight"
            f" in groups of {group} (expected {expected}); is group_size right?"
        )
    scales = scales.contiguous()
    zeros = -scales.float() * zero.float()
    return QuantizedTensor(q.contiguous(), scales, zeros, 4, group)


def _check_g_idx(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    """A g_idx other than ``k // group`` (GPTQ act-order) reorders columns across groups."""
    if g_idx is None:
        return
    trivial = torch.arange(k, dtype=torch.int64) // group
    if g_idx.shape != trivial.shape or not torch.equal(g_idx.to(torch.int64), trivial):
        raise ValueError(
            "GPTQ act-order (desc_act=true with a permuted g_idx) is not supported; "
            "use a checkpoint quantized with desc_act=false"
        )


def iter_prequantized_weights(
    stream: Iterable[tuple[str, torch.Tensor]], cfg: PrequantizedConfig
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Map a checkpoint's (name, tensor) stream: each module's qweight / qzeros / scales (/ g_idx),
    in any order, becomes one ``(prefix + ".weight", QuantizedTensor)``; every other tensor passes."""
    parts = _PARTS[cfg.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in parts:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        if len(got) == len(parts):
            yield _module_weight(cfg, prefix, pending.pop(prefix))
    for prefix, got in pending.items():
        yield _module_weight(cfg, prefix, got)


def _module_weight(
    cfg: PrequantizedConfig, prefix: str, got: dict[str, torch.Tensor]
) -> tuple[str, QuantizedTensor]:
    # g_idx is optional (exporters without act-order may leave it out): only the first three must be.
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in got]
    if missing:
        raise ValueError(f"{cfg.method} checkpoint: {prefix} lacks {', '.join(missing)}")
    try:
        if cfg.method == "gptq":
            t = gptq_tensor(cfg, got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"))
        else:
            t = awq_tensor(cfg, got["qweight"], got["qzeros"], got["scales"])
    except ValueError as e:
        raise ValueError(f"{cfg.method} checkpoint, {prefix}: {e}") from e
    return prefix + ".weight", t
