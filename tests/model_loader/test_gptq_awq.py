"""Pre-quantized GPTQ / AWQ int4 checkpoints (`tokenos.model_loader.gptq_awq`).

The checkpoints are built here: a tiny random Llama whose linears we quantize (int4, groups of 32,
asymmetric) and pack with our own code following the published layouts (AutoGPTQ's
``QuantLinear.pack``, AutoAWQ's ``WQLinear_GEMM.from_linear``); the reference is the same transformers
model with each linear's weight replaced by its dequantized values. Scales carry 6 significant bits, so
``-scale * zero`` is exact in fp16 and the comparison can stay at float32 tolerance.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.fixtures.checkpoints import LLM_SHAPE, hf_config, load_ours, perturb
from tests.fixtures.paged_runner import PagedRunner, check_request, decode_greedy, random_tokens
from tokenos.layers.quantization import QuantizedTensor
from tokenos.model_loader import gptq_awq
from tokenos.models import load_model_config

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's, spelled out again rather than imported
FORMATS = ("gptq", "gptq_v2", "awq")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- our quantizer and packers


def quantize_int4(w: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K] 0..15, scales [N, K / 32] fp16 of 6 significant bits, zero [N, K / 32] int)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    raw = (hi - lo).clamp_min(1e-3) / 15
    step = torch.exp2(torch.floor(torch.log2(raw)) - 5)
    scales = (torch.round(raw / step) * step).half()
    s = scales.float()
    zero = torch.round(-lo / s).clamp(min_zero, 15)
    q = (torch.round(g / s[..., None]) + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scales, zero.to(torch.int64)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w = (q - zero) * scale, in float32."""
    z = zero.float().repeat_interleave(GROUP, -1)
    return (q.float() - z) * scales.float().repeat_interleave(GROUP, -1)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def pack_rows(values: np.ndarray) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R / 8, C]: word r's value i = row 8r + i (GPTQ's qweight)."""
    v = values.astype(np.uint64)
    out = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint64)
    for i in range(8):
        out |= v[i::8] << (4 * i)
    return _to_int32(out)


def pack_cols(values: np.ndarray, order: list[int]) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R, C / 8]: word c's value i = column 8c + order[i]."""
    v = values.astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for i in range(8):
        out |= v[:, order[i] :: 8] << (4 * i)
    return _to_int32(out)


def pack(fmt: str, q: torch.Tensor, scales: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors in `fmt` ("gptq": v1, zeros stored minus 1; "gptq_v2"; "awq")."""
    k = q.shape[1]
    qt, zt = q.t().numpy(), zero.t().numpy()
    if fmt == "awq":
        return {
            "qweight": pack_cols(qt, AWQ_ORDER),
            "qzeros": pack_cols(zt, AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
    stored = (zt - 1) & 15 if fmt == "gptq" else zt
    return {
        "qweight": pack_rows(qt),
        "qzeros": pack_cols(stored, list(range(8))),
        "scales": scales.t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // GROUP,
    }


def quantization_config(fmt: str, **overrides) -> dict:
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}
        qc["checkpoint_format"] = fmt
    return {**qc, **overrides}


def save_quantized(fmt: str, folder: str) -> torch.nn.Module:
    """A tiny random Llama saved as a `fmt` checkpoint in `folder`; returns the dequantized reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf_config("llama", **LLM_SHAPE), dtype=torch.float32).eval()
    perturb(ref, 0.1)
    tensors = {}
    with torch.no_grad():
        for name, p in ref.state_dict().items():
            prefix = name.removesuffix(".weight")
            if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in _LINEARS:
                q, scales, zero = quantize_int4(p, min_zero=1 if fmt == "gptq" else 0)
                p.copy_(dequantize(q, scales, zero))
                tensors.update({f"{prefix}.{part}": t for part, t in pack(fmt, q, scales, zero).items()})
            else:
                tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    ref.config.save_pretrained(folder)
    edit_config(folder, architectures=["LlamaForCausalLM"], quantization_config=quantization_config(fmt))
    return ref


def edit_config(folder: str, **fields) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """format -> (folder, dequantized transformers reference), each saved once, when first asked for."""
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(fmt: str) -> tuple[str, torch.nn.Module]:
        if fmt not in cache:
            folder = str(tmp_path_factory.mktemp(fmt))
            cache[fmt] = folder, save_quantized(fmt, folder)
        return cache[fmt]

    return get


@pytest.fixture(params=FORMATS)
def checkpoint(request, built):
    """(format, folder, dequantized transformers reference)."""
    return (request.param, *built(request.param))


@pytest.fixture
def gptq_folder(built) -> str:
    return built("gptq")[0]


# ---------------------------------------------------------------- (a) unpacking


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpacking_gives_back_what_was_packed(fmt):
    torch.manual_seed(1)
    w = torch.randn(48, 96)
    w[0, :GROUP] = w[0, :GROUP].abs() + 0.1  # a group with zero 0 (v1: clamped to 1, as it cannot store 0)
    q, scales, zero = quantize_int4(w, min_zero=1 if fmt == "gptq" else 0)
    assert (zero[0, 0] == 0) == (fmt != "gptq")
    cfg = gptq_awq.parse_quantization_config(quantization_config(fmt))
    parts = pack(fmt, q, scales, zero)
    t = gptq_awq.gptq_tensor(cfg, **parts) if fmt != "awq" else gptq_awq.awq_tensor(cfg, **parts)
    assert (t.bits, t.group) == (4, GROUP)
    assert t.q.dtype == torch.uint8 and torch.equal(t.q, q)
    assert torch.equal(t.scales, scales)
    assert torch.equal(t.zeros, -scales.float() * zero.float())
    assert torch.equal(t.dequantize(), dequantize(q, scales, zero))


def test_awq_order_is_the_published_one():
    """Word value i holds column AWQ_ORDER[i]: columns 0..7 packed as 0x75316420."""
    words = pack_cols(np.arange(8)[None, :], AWQ_ORDER)
    assert words.item() == 0x75316420
    assert gptq_awq.unpack_awq(words).tolist() == [list(range(8))]
    assert gptq_awq.unpack_gptq_weight(pack_rows(np.arange(8)[:, None])).tolist() == [list(range(8))]


def test_stream_collects_parts_in_any_order_and_passes_the_rest():
    """Two modules' parts interleaved (as across shard files), a bias and a norm in between."""
    torch.manual_seed(2)
    packed = {m: quantize_int4(torch.randn(16, 64)) for m in ("a", "b")}
    parts = {m: list(pack("gptq_v2", *packed[m]).items()) for m in packed}
    norm = torch.randn(64)
    stream = [("a.norm.weight", norm)]
    for (ka, va), (kb, vb) in zip(reversed(parts["a"]), parts["b"], strict=True):
        stream += [(f"a.proj.{ka}", va), (f"b.proj.{kb}", vb)]
    stream.insert(3, ("a.proj.bias", torch.ones(16)))
    cfg = gptq_awq.parse_quantization_config(quantization_config("gptq_v2"))
    out = dict(gptq_awq.iter_prequantized_weights(stream, cfg))
    assert set(out) == {"a.norm.weight", "a.proj.bias", "a.proj.weight", "b.proj.weight"}
    assert out["a.norm.weight"] is norm
    for m, (q, _, _) in packed.items():
        assert isinstance(out[f"{m}.proj.weight"], QuantizedTensor)
        assert torch.equal(out[f"{m}.proj.weight"].q, q)


def test_trivial_g_idx_with_desc_act_is_fine():
    q, scales, zero = quantize_int4(torch.randn(16, 64))
    cfg = gptq_awq.parse_quantization_config(quantization_config("gptq_v2", desc_act=True))
    assert torch.equal(gptq_awq.gptq_tensor(cfg, **pack("gptq_v2", q, scales, zero)).q, q)


# ---------------------------------------------------------------- (b) end to end


def test_logits_and_greedy_tokens_match_the_dequantized_reference(checkpoint):
    fmt, folder, ref = checkpoint
    model, config = load_ours(folder)
    assert config.quantization == fmt.removesuffix("_v2")
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert linear.quantized is not None and linear.quantized.bits == 4  # runs packed, not dense
    runner = PagedRunner(model, block_size=16)
    runner.step([(0, random_tokens(5, 21, vocab=LLM_SHAPE["vocab_size"]))])
    decode_greedy(runner, [0], 8)
    check_request(runner, ref, 0)


# ---------------------------------------------------------------- (c) errors


def test_act_order_with_a_permuted_g_idx_is_refused():
    q, scales, zero = quantize_int4(torch.randn(16, 64))
    parts = pack("gptq_v2", q, scales, zero)
    parts["g_idx"] = parts["g_idx"].flip(0)
    cfg = gptq_awq.parse_quantization_config(quantization_config("gptq_v2", desc_act=True))
    stream = [(f"m.{k}", v) for k, v in parts.items()]
    with pytest.raises(ValueError, match="act-order"):
        list(gptq_awq.iter_prequantized_weights(stream, cfg))


def test_incomplete_module_is_refused():
    q, scales, zero = quantize_int4(torch.randn(16, 64))
    parts = pack("awq", q, scales, zero)
    cfg = gptq_awq.parse_quantization_config(quantization_config("awq"))
    stream = [("m.qweight", parts["qweight"]), ("m.scales", parts["scales"])]
    with pytest.raises(ValueError, match="m lacks qzeros"):
        list(gptq_awq.iter_prequantized_weights(stream, cfg))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"bits": 8}, "bits=8 are not supported; only 4-bit"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
        ({"is_marlin_format": True}, "checkpoint_format 'marlin' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes' are not supported"),
    ],
)
def test_unsupported_gptq_variants_are_refused(gptq_folder, tmp_path, overrides, message):
    copy = str(tmp_path / "ckpt")
    shutil.copytree(gptq_folder, copy)
    edit_config(copy, quantization_config=quantization_config("gptq", **overrides))
    with pytest.raises(ValueError, match=message):
        load_model_config(copy, dtype="float32")


def test_unsupported_awq_version_is_refused():
    qc = quantization_config("awq", version="gemv")
    with pytest.raises(ValueError, match="awq version 'gemv' is not supported"):
        gptq_awq.parse_quantization_config(qc)


@pytest.mark.parametrize("requested", ["awq", "int4", "none", "gguf"])
def test_a_mismatching_explicit_quantization_is_refused(gptq_folder, requested):
    with pytest.raises(ValueError, match=f"quantized with gptq; quantization='{requested}' does not match"):
        load_model_config(gptq_folder, dtype="float32", quantization=requested)


def test_the_matching_explicit_quantization_is_accepted(checkpoint):
    fmt, folder, _ = checkpoint
    method = fmt.removesuffix("_v2")
    assert load_model_config(folder, dtype="float32", quantization=method).quantization == method


def test_gptq_on_a_dense_checkpoint_is_refused(tmp_path):
    hf_config("llama", **LLM_SHAPE).save_pretrained(str(tmp_path))
    edit_config(str(tmp_path), architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="needs a checkpoint quantized with gptq"):
        load_model_config(str(tmp_path), dtype="float32", quantization="gptq")
