"""Decode steps of a Llama-style stack with quantized linears, one C call per layer.

At decode sizes a layer's work is a dozen small kernels (two norms, four weight-only GEMVs, rotary, the
KV write, paged attention, SiLU-and-mul), and each costs a Python call, a ctypes conversion and a torch
allocation around a few microseconds of arithmetic: together about as long as reading the layer's
packed weights. `csrc/decode_layer.c` runs the same kernels back to back from C, with the module path's
roundings, so its hidden states equal the module path's bit for bit (tests/layers/test_fused_decode.py);
the module path stays the reference and takes every other step.

`FusedDecodePlan.build(stack)` says once per model whether every layer qualifies: Llama's
``DecoderLayer`` exactly (no q/k norms, no output scale), plain RMSNorms, SiLU gating, all four linears
quantized with the C kernel for the model's dtype and no LoRA, attention without soft cap or sinks.
`takes(batch)` says per step whether every request has at most ``max_query`` tokens (a decode, and the
drafts being verified when speculating), on pages of the model's dtype or 8-bit (fp8, int8) pages whose
scales are settled (written and read as the module path does). A step of decodes only is the
module path's arithmetic exactly; a token among several of its request attends through the decode
kernel as a decode of its own length, where the module path takes the prefill kernel (the same
attention, summed in another order).
``TOKENOS_DISABLE_FUSED_DECODE=1`` turns it off (the module path then runs every step).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from tokenos.layers import attention, cpu_kernels
from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.attention_metadata import AttentionMetadata
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import RotaryEmbedding

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class LayerDesc(ctypes.Structure):
    """csrc/decode_layer.c's ``layer_desc``."""

    _fields_ = [
        ("qkv", _P),
        ("o", _P),
        ("gate_up", _P),
        ("down", _P),
        ("qkv_bias", _P),
        ("ln1", _P),
        ("ln2", _P),
        ("kv_cache", _P),
        ("page_stride", _I64),
        ("eps", _F),
        ("scale", _F),
        ("window", _I32),
        ("kv_kind", _I32),
        ("k_write", _F),
        ("v_write", _F),
        ("v_scale", _F),
        ("_pad", _I32),
    ]


# csrc/decode_layer.c's kv_kind: pages of the model's dtype, or 8-bit pages with per-layer scales.
_KV_KINDS = {torch.float8_e4m3fn: 1, torch.int8: 2}


_SCRATCH = ("h", "qkv", "attn", "gu", "act", "qf", "of")


class StepDesc(ctypes.Structure):
    """csrc/decode_layer.c's ``step_desc``."""

    _fields_ = [
        ("n", _I64),
        *((name, _I32) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "rotary_dim")),
        ("block_size", _I32),
        ("max_blocks", _I32),
        *((name, _P) for name in ("block_table", "seq_lens", "slots", "epochs", "cos", "sin")),
        *((name, _P) for name in _SCRATCH),
    ]


@dataclass
class _Layer:
    desc: LayerDesc
    attn: Attention
    keep: tuple  # tensors whose addresses the desc holds


def _quantized_kernel(linear: Linear, dtype: torch.dtype, bias_ok: bool) -> bool:
    q = linear.quantized
    if q is None or linear.lora is not None or (linear.bias is not None and not bias_ok):
        return False
    return q._gemms.get(dtype) is not None


def _qualifies(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    from tokenos.models.llama import DecoderAttention, DecoderLayer, GatedMLP

    if type(layer) is not DecoderLayer or layer.output_scale is not None:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if (
        type(attn) is not DecoderAttention
        or hasattr(attn, "q_norm")
        or type(attn.rotary) is not RotaryEmbedding
    ):
        return False
    core = attn.attn
    if type(core) is not Attention or core.logit_softcap is not None or core.sinks is not None:
        return False
    if core.head_size > cpu_kernels.MAX_HEAD_SIZE:
        return False
    if not isinstance(mlp, GatedMLP) or type(mlp.act) is not SiluAndMul:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms) or norms[0].eps != norms[1].eps:
        return False  # the C layer takes one eps for both norms
    linears = ((attn.qkv_proj, True), (attn.o_proj, False), (mlp.gate_up_proj, False), (mlp.down_proj, False))
    return all(_quantized_kernel(lin, dtype, bias_ok) for lin, bias_ok in linears)


class FusedDecodePlan:
    # A request's tokens per step taken here: a decode and up to 15 drafts, or a chunk that short. Token t
    # attends as a decode of length position + 1 (its K/V and the earlier ones of the step are written
    # first, so it sees exactly its causal prefix); longer chunks go to the tiled prefill kernel, which
    # reads each K/V row once per chunk instead of once per token. Where cascade attention is off (a
    # sliding window; float32 pages on AVX-512 without the AVX2 cascade) nothing groups a request's tokens
    # over their common pages, so each token reads its whole context: there the limit stays at a decode
    # and 7 drafts.
    # On an AMX Xeon a 9-token verify step took 16.1 ms through the module path, 10.1 ms here.
    max_query = 16
    max_query_ungrouped = 8
    keep_rows = 512  # tokens up to which a step's scratch is kept for the next (_scratch_rows)

    def __init__(self, stack: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.fn = getattr(cpu_kernels.load(), f"decode_layers_{cpu_kernels.DTYPES[dtype]}")
        first = stack.layers[0]
        attn = first.self_attn
        self.hidden = first.input_layernorm.weight.shape[0]
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = first.mlp.down_proj.input_size
        self.rotary = attn.rotary
        self.layers = [self._layer(layer) for layer in stack.layers]
        # The C call takes every layer at once: their descs' addresses, and each one's step desc.
        self._layer_ptrs = (_P * len(self.layers))(*(ctypes.addressof(lyr.desc) for lyr in self.layers))
        self._step_ptrs = (_P * len(self.layers))()
        self._scratch: tuple[torch.Tensor, ...] = ()
        windowed = any(layer.desc.window for layer in self.layers)
        # Page dtype -> whether cascade groups a request's tokens over them (asked once, not every step).
        self._grouped = {kv: not windowed and cpu_kernels.uses_cascade(kv) for kv in (dtype, *_KV_KINDS)}
        self.grouped = self._grouped[dtype]

    @classmethod
    def build(cls, stack: torch.nn.Module) -> FusedDecodePlan | None:
        """The plan for ``stack`` (a llama ``DecoderModel``), or None where some layer does not qualify."""
        if os.environ.get("TOKENOS_DISABLE_FUSED_DECODE") == "1" or cpu_kernels.load() is None:
            return None
        layers = list(stack.layers)
        norm = getattr(layers[0], "input_layernorm", None) if layers else None
        if norm is None:
            return None
        dtype = norm.weight.dtype
        if dtype not in cpu_kernels.DTYPES or not all(_qualifies(layer, dtype) for layer in layers):
            return None
        shapes = {
            (lyr.self_attn.num_heads, lyr.self_attn.num_kv_heads, lyr.self_attn.head_dim) for lyr in layers
        }
        if len(shapes) != 1 or len({id(lyr.self_attn.rotary) for lyr in layers}) != 1:
            return None
        return cls(stack, dtype)

    def _layer(self, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        bias = attn.qkv_proj.bias
        bias = None if bias is None else bias.detach().to(self.dtype).contiguous()
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        desc = LayerDesc(
            qkv=attn.qkv_proj.quantized._desc_address,
            o=attn.o_proj.quantized._desc_address,
            gate_up=mlp.gate_up_proj.quantized._desc_address,
            down=mlp.down_proj.quantized._desc_address,
            qkv_bias=None if bias is None else bias.data_ptr(),
            ln1=ln1.weight.data_ptr(),
            ln2=ln2.weight.data_ptr(),
            eps=ln1.eps,
            scale=attn.attn.scale,
            window=attn.attn.sliding_window or 0,
        )
        return _Layer(desc, attn.attn, (bias, ln1.weight, ln2.weight))

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether every request of this step has at most ``max_query`` tokens (a decode, with its drafts
        when speculating) and the pages are ones the kernel reads: whole-row pages of the model's dtype,
        or 8-bit ones whose scales no later step changes (a layer still to calibrate takes the module
        path, which calibrates it)."""
        n = batch.input_ids.shape[0]
        if n == 0:
            return False
        checked: set[int] = set()  # layers of one KV-cache group share their metadata
        for layer in self.layers:
            kv_cache, meta = layer.attn.cache_entry(batch)
            if not self._reads(layer.attn, kv_cache):
                return False
            if id(meta) not in checked:
                grouped = self._grouped.get(kv_cache.dtype, False)
                limit = self.max_query if grouped else min(self.max_query, self.max_query_ungrouped)
                lens = meta.query_lens_list
                if max(lens) > limit or sum(lens) != n:
                    return False
                checked.add(id(meta))
        return True

    def _reads(self, attn: Attention, kv_cache: torch.Tensor) -> bool:
        if kv_cache.dtype != self.dtype and not (
            kv_cache.dtype in _KV_KINDS and attn.kv_scales_settled(kv_cache.dtype)
        ):
            return False
        return attention._use_c_kernel(kv_cache)

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after every layer, as the module path leaves them."""
        n = x.shape[0]
        x = x.to(self.dtype).contiguous().clone()
        residual = torch.empty_like(x)
        scratch = self._scratch_rows(n)
        cos, sin = (t.contiguous() for t in self.rotary.cos_sin(batch.positions, self.dtype))
        steps: dict[int, tuple[StepDesc, tuple]] = {}  # holds the step descs' tensors until the call
        for i, layer in enumerate(self.layers):
            kv_cache, meta = layer.attn.cache_entry(batch)
            step = steps.get(id(meta))
            if step is None:
                step = steps[id(meta)] = self._step(meta, batch, cos, sin, scratch)
            layer.desc.kv_cache = kv_cache.data_ptr()
            layer.desc.page_stride = kv_cache.stride(0)
            _set_scales(layer.desc, layer.attn, kv_cache.dtype)
            self._step_ptrs[i] = ctypes.addressof(step[0])
        self.fn(self._layer_ptrs, self._step_ptrs, len(self.layers), x.data_ptr(), residual.data_ptr())
        return x, residual

    def _scratch_rows(self, n: int) -> tuple[torch.Tensor, ...]:
        """The layers' scratch for n tokens: the first n rows of buffers kept between steps (grown to a
        power of two as batches grow), so a step allocates nothing that grows with its batch; fresh
        ones each step were about 1.2 MB at 64 decodes, much of it new pages to fault in. Past
        ``keep_rows`` tokens (drafts of a large batch) the buffers are the step's own, not kept."""
        if n > self.keep_rows:
            return self._new_scratch(n)
        if not self._scratch or self._scratch[0].shape[0] < n:
            self._scratch = self._new_scratch(1 << max(n - 1, 0).bit_length())
        return tuple(t[:n] for t in self._scratch)

    def _new_scratch(self, rows: int) -> tuple[torch.Tensor, ...]:
        q_width = self.heads * self.head_dim
        width = q_width + 2 * self.kv_heads * self.head_dim
        return (
            torch.empty(rows, self.hidden, dtype=self.dtype),
            torch.empty(rows, width, dtype=self.dtype),
            torch.empty(rows, q_width, dtype=self.dtype),
            torch.empty(rows, 2 * self.inter, dtype=self.dtype),
            torch.empty(rows, self.inter, dtype=self.dtype),
            torch.empty(rows, q_width, dtype=torch.float32),
            torch.empty(rows, q_width, dtype=torch.float32),
        )

    def _step(self, meta: AttentionMetadata, batch: ForwardBatch, cos, sin, scratch: tuple):
        n = batch.input_ids.shape[0]
        # Each token a decode of its request's pages up to its own position (a plain decode's seq_len).
        owner = torch.repeat_interleave(torch.tensor(meta.query_lens_list))
        table = meta.block_table.index_select(0, owner).to(torch.int32).contiguous()
        lens = (batch.positions[:n] + 1).to(torch.int32).contiguous()
        slots = meta.slot_mapping[:n].to(torch.int64).contiguous()
        desc = StepDesc(
            n=n,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            inter=self.inter,
            rotary_dim=self.rotary.rotary_dim,
            block_size=meta.block_size,
            max_blocks=table.shape[1],
            block_table=table.data_ptr(),
            seq_lens=lens.data_ptr(),
            slots=slots.data_ptr(),
            epochs=None if meta.page_epochs is None else meta.page_epochs.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            **{name: t.data_ptr() for name, t in zip(_SCRATCH, scratch, strict=True)},
        )
        return desc, (table, lens, slots)


def _set_scales(desc: LayerDesc, attn: Attention, kv_dtype: torch.dtype) -> None:
    """The layer's scales as the module path applies them (attention.py): on 8-bit pages the softmax
    scale times k_scale, the outputs times v_scale, and what the 8-bit write takes
    (`cpu_kernels.kv_write_scales`), each a Python float rounded once to float32 as the ctypes calls
    there round it."""
    desc.kv_kind = _KV_KINDS.get(kv_dtype, 0)
    if not desc.kv_kind:
        desc.scale = attn.scale
        return
    desc.scale = attn.scale * attn.k_scale
    desc.k_write, desc.v_write = cpu_kernels.kv_write_scales(kv_dtype, attn.k_scale, attn.v_scale)
    desc.v_scale = attn.v_scale
