"""GGUF checkpoints: the config from ``<arch>.*`` keys and weights dequantized to HF names.

llama.cpp's converter renames every tensor (``blk.N.attn_q`` ...) and, for the llama
architecture only, permutes the rows of q and k so that rotary pairs are interleaved. We
rename back to Hugging Face names and undo that permutation, so the model code sees exactly
what it would see from a safetensors folder.

Quantized blocks stay quantized where our packed layout holds them (`gguf_quantized`): Q8_0 is int8 with
one fp16 scale per 32, Q4_0 is int4 with scale d and zero -8d, Q4_1 int4 with scale d and zero m (all
exact). The K-quants' sub-blocks map with their two-level scales multiplied out and rounded once to fp16
(relative error 2^-11 of a scale): Q4_K is int4 per 32 with scale d * sc and zero -dmin * m, Q5_K the
same in int8 (its values are 5 bits), Q6_K int8 per 16 with scale d * scale and values q - 32. Those
tensors are yielded as `QuantizedTensor`s; every other block type (IQ*, Q2_K, Q3_K, ...) is dequantized
to float32, and the load says so in one log line.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tokenos.layers.quantization import QuantizedTensor
from tokenos.model_loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# GGUF tensor name (without blk.N. prefix and .weight/.bias suffix) -> HF module path.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF general.architecture -> the Hugging Face architecture name our registry knows it by.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """One parsed file per path, shared by config resolution and weight loading."""
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def read_gguf_config(path: str) -> dict[str, Any]:
    """ModelConfig fields (without dtype/max_model_len resolution) from a GGUF's metadata."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF rope_freqs (Llama 3.1-style rope scaling) is not supported yet")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    unscaled = scaling == "none" or (scaling == "linear" and factor == 1)
    if not unscaled:  # yarn / linear metadata: running it as default rope would be silently wrong
        raise ValueError(f"{path}: GGUF {arch}.rope.scaling.type {scaling!r} is not supported yet")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "architecture": GGUF_ARCHITECTURES[arch],
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "vocab_size": _field(reader, f"{arch}.vocab_size", embd.shape[0]),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "sliding_window": None,
        "eos_token_ids": _ids(_field(reader, "tokenizer.ggml.eos_token_id")),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "gguf_file": os.path.basename(path),
    }


def _ids(value: int | None) -> tuple[int, ...]:
    return () if value is None else (int(value),)


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF rotate-half layout)."""
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


# ggml type -> bytes per block of the block types QuantizedTensor holds (32 weights; K-quants 256).
_Q8_0, _Q4_0, _Q4_1, _Q4_K, _Q5_K, _Q6_K = 8, 2, 3, 12, 13, 14
_KEPT_TYPES = {_Q8_0: 34, _Q4_0: 18, _Q4_1: 20, _Q4_K: 144, _Q5_K: 176, _Q6_K: 210}
_QK_K = 256
_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: not "dequantized" when converted


def gguf_quantized(raw: np.ndarray, ggml_type: int) -> QuantizedTensor | None:
    """A 2-D GGUF tensor's raw rows ([N, bytes per row]) as a `QuantizedTensor`, or None for a block type
    it does not hold (dequantize it instead). ``dequantize()`` equals gguf's own exactly for Q8_0 / Q4_0 /
    Q4_1, and up to one fp16 rounding of each sub-block's scale and zero for the K-quants."""
    block = _KEPT_TYPES.get(ggml_type)
    if block is None or raw.ndim != 2:
        return None
    n = raw.shape[0]
    if ggml_type in (_Q4_K, _Q5_K, _Q6_K):
        return _k_quantized(np.ascontiguousarray(raw).reshape(-1, block), n, ggml_type)
    blocks = np.ascontiguousarray(raw).reshape(n, -1, block)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16).reshape(n, -1))
    if ggml_type == _Q8_0:
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, -1))
        return QuantizedTensor(q, d, None, 8, 32)
    packed = blocks[..., 4 if ggml_type == _Q4_1 else 2 :]
    # Each block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble).
    nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(n, -1)
    q = torch.from_numpy(np.ascontiguousarray(nibbles))
    if ggml_type == _Q4_1:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, -1))
        return QuantizedTensor(q, d, m, 4, 32)
    return QuantizedTensor(q, d, d * -8, 4, 32)


def _k_quantized(blocks: np.ndarray, n: int, ggml_type: int) -> QuantizedTensor:
    """K-quant super-blocks ([blocks, bytes]) as a `QuantizedTensor` of ``n`` rows, unpacked as
    ``gguf.quants`` dequantizes them, with each sub-block's scale (and zero) multiplied out."""
    from gguf.quants import Q4_K

    nb = blocks.shape[0]
    if ggml_type == _Q6_K:
        ql, qh = blocks[:, : _QK_K // 2], blocks[:, _QK_K // 2 : _QK_K // 2 + _QK_K // 4]
        scales = blocks[:, _QK_K // 2 + _QK_K // 4 : -2].view(np.int8).astype(np.float32)
        d = blocks[:, -2:].copy().view(np.float16).astype(np.float32)
        lo = (ql.reshape(nb, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (lo.reshape(nb, -1, 32) | (hi.reshape(nb, -1, 32) << 4)).astype(np.int8) - np.int8(32)
        s = (d * scales).astype(np.float16).reshape(n, -1)
        return QuantizedTensor(torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(s), None, 8, 16)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    # Q5_K's fifth bits come before its nibbles; each 32 bytes of nibbles hold two sub-blocks.
    qh, qs = (None, blocks[:, 16:]) if ggml_type == _Q4_K else np.hsplit(blocks[:, 16:], [_QK_K // 8])
    q = ((qs.reshape(nb, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(
        nb, -1, 32
    )
    bits = 4
    if qh is not None:
        hi = (qh.reshape(nb, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = (q | (hi.reshape(nb, -1, 32) << 4)).astype(np.int8)
        bits = 8
    scales = (d * sc.astype(np.float32)).astype(np.float16).reshape(n, -1)
    zeros = (-(dmin * m.astype(np.float32))).astype(np.float16).reshape(n, -1)
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(n, -1))
    return QuantizedTensor(q, torch.from_numpy(scales), torch.from_numpy(zeros), bits, 32)


def iter_gguf_weights(
    path: str, num_heads: int, num_kv_heads: int, keep_quantized: bool = True
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, tensor) for every tensor, un-permuted: a `QuantizedTensor` for the 2-D weights
    whose blocks stay quantized (with ``keep_quantized``), float32 for every other one."""
    # A reader of its own, not open_gguf's shared one: unmapped once every tensor is copied out, so the
    # file's pages do not stay resident beside the weights made from them.
    reader = GGUFFile(path)
    permuted = _field(reader, "general.architecture") == "llama"
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope_freqs: not a module weight
        if permuted and name.endswith("q_proj.weight"):
            fix = functools.partial(unpermute_qk, n_head=num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            fix = functools.partial(unpermute_qk, n_head=num_kv_heads)
        else:
            fix = None
        quantized = gguf_quantized(reader.raw(tensor), tensor.ggml_type) if keep_quantized else None
        if quantized is not None:
            yield name, quantized if fix is None else quantized.map_rows(fix)
            continue
        if tensor.ggml_type not in _FLOAT_TYPES:
            dequantized[_type_name(tensor.ggml_type)] += 1
        array = reader.dequantize(tensor)
        array = array if fix is None else fix(array)
        yield name, torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    reader.close()
    if dequantized:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items()))
        logger.info(
            "GGUF: dequantized %s tensor(s) at load (kept quantized: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)",
            kinds,
        )


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name
