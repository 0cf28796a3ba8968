"""A minimal GGUF reader: scalar metadata and raw tensor views, in milliseconds.

``gguf.GGUFReader`` builds a numpy view for every element of every array field; for a model
with a 49k-token vocabulary that is seconds spent on tokenizer data the model never needs.
This reader walks the same format (header, key/values, tensor infos, aligned data) with
``struct`` over an mmap, skipping arrays, and hands raw tensor bytes to
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file


class GGUFFile:
    """``fields``: scalar and string metadata (arrays map to None, `array` reads a scalar one on demand);
    ``tensors``: in file order."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version, num_tensors, num_fields = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        self.fields: dict[str, Any] = {}
        self._arrays: dict[str, int] = {}  # array key -> where its item type starts
        for _ in range(num_fields):
            key = self._read_str()
            value_type = self._read("<I")
            if value_type == _ARRAY:
                self._arrays[key] = self._pos
            self.fields[key] = self._read_value(value_type)
        infos = [self._read_tensor_info() for _ in range(num_tensors)]
        alignment = self.fields.get("general.alignment") or DEFAULT_ALIGNMENT
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def array(self, key: str) -> list[Any] | None:
        """The items of array field ``key`` (scalars only; a per-layer value such as a sliding-window
        pattern), or None where the file has no such array."""
        pos = self._arrays.get(key)
        if pos is None:
            return None
        item_type, count = struct.unpack_from("<IQ", self._map, pos)
        if item_type not in _SCALARS:
            raise ValueError(f"GGUF array {key!r} holds non-scalar items")
        fmt = _SCALARS[item_type]
        return list(struct.unpack_from(f"<{count}{fmt[1:]}", self._map, pos + 12))

    def close(self) -> None:
        """Unmap the file: its pages stop counting as the process's memory once the weights are copied
        out. A no-op while numpy views into it are still alive."""
        try:
            self._map.close()
        except BufferError:
            pass

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("<Q")
        self._pos += n
        return self._map[self._pos - n : self._pos].decode("utf-8", errors="replace")

    def _read_value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._read_str()
        if value_type == _ARRAY:
            self._skip_array()
            return None
        return self._read(_SCALARS[value_type])

    def _skip_array(self) -> None:
        item_type, count = self._read("<I"), self._read("<Q")
        if item_type in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item_type])
            return
        for _ in range(count):
            self._read_value(item_type)

    def _read_tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._read_str()
        dims = [self._read("<Q") for _ in range(self._read("<I"))]
        ggml_type, offset = self._read("<I"), self._read("<Q")
        return name, tuple(reversed(dims)), ggml_type, offset

    def raw(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 rows [*outer dims, bytes per row], as dequantize wants."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        row_bytes = tensor.shape[-1] // block_size * type_size
        count = int(np.prod(tensor.shape[:-1], dtype=np.int64)) * row_bytes
        data = np.frombuffer(self._map, dtype=np.uint8, count=count, offset=tensor.offset)
        return data.reshape(*tensor.shape[:-1], row_bytes)

    def dequantize(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """float32 array of ``tensor.shape``."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(self.raw(tensor), GGMLQuantizationType(tensor.ggml_type)).reshape(tensor.shape)
