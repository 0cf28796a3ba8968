"""GGUF checkpoints: the config from ``<arch>.*`` keys and weights under their Hugging Face names.

Every architecture llama.cpp defines and tokenos runs natively loads (`GGUF_FAMILIES`): llama, qwen2,
qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3, olmo2, granite, gpt-oss. llama.cpp's converter renames every
tensor (``blk.N.attn_q`` ...) and changes a few on the way; we undo each change, so the model code sees
exactly what it would see from a safetensors folder:

- the llama converter (and Granite's, its subclass) permutes the rows of q and k (weights and biases) so
  that rotary pairs are interleaved: un-permuted;
- Gemma's converter stores every RMSNorm weight as ``1 + w`` (transformers' GemmaRMSNorm scales by
  ``1 + w``, llama.cpp by the stored weight): we subtract the 1 again;
- MoE experts are stacked per projection ``[E, out, in]`` (``ffn_gate_exps`` ...): split per expert;
  gpt-oss's stay stacked as its checkpoint holds them (`_GptOssExperts`): gate and up interleaved row by
  row again, MXFP4 blocks re-laid as the checkpoint's ``*_blocks`` / ``*_scales`` (the same e2m1 codes and
  e8m0 scales, so lossless), other types dequantized;
- names differ per family: Gemma's ``ffn_norm`` is its pre-MLP norm, OLMo 2 / Gemma's post-norms are
  ``post_attention_norm`` / ``post_ffw_norm``, Phi-3 keeps q/k/v and gate/up fused (``attn_qkv``,
  ``ffn_up``), gpt-oss's sinks are ``attn_sinks.weight`` (a bare ``self_attn.sinks`` in the checkpoint).

What the converter writes beyond the Llama keys goes into ``hf_config`` under transformers' names, where
the model code reads it for a folder too: Gemma's window, layer pattern, soft caps, query scale and (Gemma
3) sliding-layer rope base, Phi-3's partial rotary, window and longrope factors, the experts' counts and
sizes, Granite's multipliers. What llama.cpp hardcodes instead of writing, we hardcode as it does (Gemma
2's window 4096 and caps 50 / 30 when absent, Gemma 3's five sliding layers in six and sliding base
10000, Gemma's 27B query scale, Qwen3-MoE's renormalized top-k, gpt-oss's sliding even layers and its
SwiGLU clamp 7.0 / alpha 1.702). Metadata that would change the model
and that a family does not read (soft caps or multipliers elsewhere, experts in a llama file, a non-softmax
router, partial rotary outside Phi-3, a rope scaling other than linear / Phi-3's longrope / gpt-oss's yarn) is
refused
with a ValueError naming the key, never run as the plain model.

Quantized blocks stay quantized where our packed layout holds them (`gguf_quantized`): Q8_0 is int8 with
one fp16 scale per 32, Q4_0 is int4 with scale d and zero -8d, Q4_1 int4 with scale d and zero m (all
exact). The K-quants' sub-blocks map with their two-level scales multiplied out and rounded once to fp16
(relative error 2^-11 of a scale): Q4_K is int4 per 32 with scale d * sc and zero -dmin * m, Q5_K the
same in int8 (its values are 5 bits), Q6_K int8 per 16 with scale d * scale and values q - 32. Those
tensors (MoE experts included, one per expert) are yielded as `QuantizedTensor`s; every other block type
(IQ*, Q2_K, Q3_K, ...) is dequantized to float32, and the load says so in one log line.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenos.layers.quantization import QuantizedTensor
from tokenos.model_loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# GGUF tensor name (without blk.N. prefix and .weight/.bias suffix) -> HF module path, as llama.cpp's
# converter names the Llama-like blocks.
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
# Qwen MoE: the router, the shared expert and its gate. The experts themselves are one stacked
# [E, out, in] tensor per projection (`_EXPERT_NAMES`), split back into one tensor per expert.
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma normalizes both sides of both sublayers: its GGUF ffn_norm is the pre-MLP norm (Llama's is the
# post-attention one, which Gemma's GGUF calls post_attention_norm).
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_OLMO2_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # stored fused, as in HF
_GPT_OSS_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
# gpt-oss's expert stacks (`_GptOssExperts`); recent converters may write gate and up fused.
_GPT_OSS_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
# Checkpoint parameters without a .weight suffix, which the converter adds.
_BARE_PARAMS = ("self_attn.sinks",)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFFamily:
    """How llama.cpp writes one architecture, as far as loading it back needs."""

    architecture: str  # the Hugging Face name our registry knows it by
    layer_names: dict[str, str] = field(default_factory=lambda: _LAYER_NAMES)
    # llama.cpp's LlamaModel converter (llama, granite) interleaves the rotary pairs of q / k rows.
    permuted_qk: bool = False
    # Gemma's converter stores every RMSNorm weight as 1 + w; our GemmaRMSNorm takes w.
    norm_plus_one: bool = False
    # attn_q_norm / attn_k_norm are per head (Qwen3, Gemma 3), not over all heads (OLMo 2's own).
    per_head_qk_norm: bool = True
    # rope.dimension_count may rotate part of each head (Phi-3's partial_rotary_factor).
    partial_rotary: bool = False
    # Keys of `_NEUTRAL_VALUES` (after "<arch>.") this family reads; elsewhere a value other than the
    # neutral one is refused.
    keys: frozenset[str] = frozenset()
    # Yarn rope scaling is read, with transformers' ``truncate`` for the family (None: yarn refused).
    yarn_truncate: bool | None = None
    # The experts stay stacked as the checkpoint holds them (gpt-oss), instead of split per expert.
    stacked_experts: bool = False


_GEMMA_KEYS = frozenset(
    {
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "attention.scale",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope.freq_base_swa",
    }
)
_MOE_KEYS = frozenset(
    {
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        "expert_weights_norm",
        "expert_gating_func",
    }
)
_GRANITE_KEYS = frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"})
_GPT_OSS_KEYS = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length"})

GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM"),
    "qwen3": GGUFFamily("Qwen3ForCausalLM"),
    "qwen2moe": GGUFFamily("Qwen2MoeForCausalLM", {**_LAYER_NAMES, **_MOE_NAMES}, keys=_MOE_KEYS),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", {**_LAYER_NAMES, **_MOE_NAMES}, keys=_MOE_KEYS),
    "gemma2": GGUFFamily(
        "Gemma2ForCausalLM", {**_LAYER_NAMES, **_GEMMA_NAMES}, norm_plus_one=True, keys=_GEMMA_KEYS
    ),
    "gemma3": GGUFFamily(
        "Gemma3ForCausalLM", {**_LAYER_NAMES, **_GEMMA_NAMES}, norm_plus_one=True, keys=_GEMMA_KEYS
    ),
    "phi3": GGUFFamily("Phi3ForCausalLM", {**_LAYER_NAMES, **_PHI3_NAMES}, partial_rotary=True),
    "olmo2": GGUFFamily("Olmo2ForCausalLM", {**_LAYER_NAMES, **_OLMO2_NAMES}, per_head_qk_norm=False),
    "granite": GGUFFamily("GraniteForCausalLM", permuted_qk=True, keys=_GRANITE_KEYS),
    # gpt-oss's converter is a plain TextModel: no q/k permutation (llama.cpp runs it with NEOX rope).
    "gpt-oss": GGUFFamily(
        "GptOssForCausalLM",
        {**_LAYER_NAMES, **_GPT_OSS_NAMES},
        keys=_GPT_OSS_KEYS,
        yarn_truncate=False,
        stacked_experts=True,
    ),
}
# GGUF general.architecture -> the Hugging Face architecture name our registry knows it by.
GGUF_ARCHITECTURES = {arch: family.architecture for arch, family in GGUF_FAMILIES.items()}

# Keys that change the model, with the value that leaves it as the plain decoder (None: any value does).
# A family that does not read one refuses a file that sets it otherwise, rather than run another model.
_NEUTRAL_VALUES: dict[str, float | None] = {
    "attention.sliding_window_pattern": None,
    "attention.scale": None,
    "attn_logit_softcapping": 0.0,
    "final_logit_softcapping": 0.0,
    "embedding_scale": 1.0,
    "residual_scale": 1.0,
    "logit_scale": 1.0,
    "expert_count": 0,
    "expert_weights_scale": 1.0,
    "rope.freq_base_swa": None,
}
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """One parsed file per path, shared by config resolution and weight loading."""
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def gguf_family(arch: str | None) -> GGUFFamily:
    """The loading rules of GGUF architecture ``arch``; ValueError naming the supported ones."""
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_FAMILIES)}")
    return GGUF_FAMILIES[arch]


class _Meta:
    """``<arch>.*`` metadata of one file, read by the key after the architecture prefix."""

    def __init__(self, reader: GGUFFile, arch: str, path: str) -> None:
        self.reader, self.arch, self.path = reader, arch, path
        self.names = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, f"{self.arch}.{key}", default)

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def has(self, key: str) -> bool:
        full = f"{self.arch}.{key}"
        return full in self.reader.fields

    def refuse(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: GGUF {what} is not supported yet")


def read_gguf_config(path: str) -> dict[str, Any]:
    """ModelConfig fields (without dtype/max_model_len resolution) from a GGUF's metadata; the family's
    own settings (soft caps, experts, multipliers) go into ``hf_config`` under transformers' names, where
    the model code reads them for a Hugging Face folder too."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch)
    meta = _Meta(reader, arch, path)
    _refuse_unread_keys(meta, family)
    theta, scaling = _rope(meta, family)
    hidden, heads = meta.required("embedding_length"), meta.required("attention.head_count")
    head_dim = meta.get("attention.key_length", hidden // heads)
    _check_head_dims(meta, head_dim, family.partial_rotary)
    embd = meta.names["token_embd.weight"]
    layers = meta.required("block_count")
    fields = {
        "architecture": family.architecture,
        "hidden_size": hidden,
        "intermediate_size": meta.get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": meta.get("vocab_size", embd.shape[0]),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": meta.get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in meta.names,
        "attention_bias": "blk.0.attn_q.bias" in meta.names,
        "qk_norm": family.per_head_qk_norm and "blk.0.attn_q_norm.weight" in meta.names,
        "sliding_window": None,
        "layer_sliding_windows": (None,) * layers,
        "eos_token_ids": _ids(_field(reader, "tokenizer.ggml.eos_token_id")),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "gguf_file": os.path.basename(path),
        "hf_config": {
            "num_hidden_layers": layers,
            "max_position_embeddings": meta.get("context_length", 2048),
        },
    }
    extra = _FAMILY_FIELDS.get(arch)
    if extra is not None:
        extra(meta, fields)
    return fields


def _refuse_unread_keys(meta: _Meta, family: GGUFFamily) -> None:
    for key, neutral in _NEUTRAL_VALUES.items():
        if key in family.keys or not meta.has(key):
            continue
        value = meta.get(key)
        if neutral is None or value is None or float(value) != neutral:
            raise meta.refuse(f"{meta.arch}.{key} = {value!r}")


def _check_head_dims(meta: _Meta, head_dim: int, partial_rotary: bool) -> None:
    """Value heads wider than keys, or rotary over part of a head, would run silently wrong here."""
    value_dim = meta.get("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise meta.refuse(f"attention.value_length {value_dim} != key_length {head_dim}")
    rotary = meta.get("rope.dimension_count", head_dim)
    if rotary != head_dim and not partial_rotary:
        raise meta.refuse(f"{meta.arch}.rope.dimension_count {rotary} (partial rotary of {head_dim})")


def _rope(meta: _Meta, family: GGUFFamily) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of the full-attention layers. Linear scaling is read, Phi-3's longrope (its
    factor tensors, `_phi3_longrope`) and yarn where the family runs it (`_yarn`); every other type is
    refused (running it as default rope would be silently wrong)."""
    if "rope_freqs.weight" in meta.names:
        raise meta.refuse("rope_freqs (Llama 3.1-style rope scaling)")
    theta = float(meta.get("rope.freq_base", 10000.0))
    if "rope_factors_long.weight" in meta.names:
        if meta.arch != "phi3":
            raise meta.refuse(f"rope_factors_long / rope_factors_short (longrope) for {meta.arch}")
        return theta, _phi3_longrope(meta)
    scaling = meta.get("rope.scaling.type", "none")
    factor = meta.get("rope.scaling.factor")
    if scaling == "none" or (scaling == "linear" and factor in (None, 1)):
        return theta, None
    if scaling == "linear":
        return theta, {"rope_type": "linear", "factor": float(factor)}
    if scaling == "yarn" and family.yarn_truncate is not None:
        return theta, _yarn(meta, float(factor), family.yarn_truncate)
    raise meta.refuse(f"{meta.arch}.rope.scaling.type {scaling!r}")


def _yarn(meta: _Meta, factor: float, truncate: bool) -> dict[str, Any]:
    """Yarn under transformers' names; llama.cpp's defaults (beta 32 / 1) where the converter wrote none.
    Its knobs that transformers' yarn does not have are refused unless neutral."""
    for key, neutral in (("rope.scaling.yarn_ext_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.0)):
        value = meta.get(key)
        if value is not None and float(value) != neutral:
            raise meta.refuse(f"{meta.arch}.{key} = {value!r}")
    scaling = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(meta.required("rope.scaling.original_context_length")),
        "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": truncate,
    }
    attention = meta.get("rope.scaling.yarn_attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _ids(value: int | None) -> tuple[int, ...]:
    return () if value is None else (int(value),)


# llama.cpp's defaults where a Gemma file leaves a key out (llama_hparams / its Gemma loaders).
_GEMMA2_WINDOW, _GEMMA2_ATTN_CAP, _GEMMA2_FINAL_CAP = 4096, 50.0, 30.0
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_SWA_THETA = 10000.0
# Gemma's 27B models scale queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5; llama.cpp
# tells them apart by their layer count, since the converter writes no scale.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_fields(meta: _Meta, fields: dict[str, Any]) -> None:
    """Sliding layers, softmax scale, soft caps and (Gemma 3) the sliding layers' own rotary base."""
    arch, layers, cfg = meta.arch, fields["num_hidden_layers"], fields["hf_config"]
    window = meta.get("attention.sliding_window", _GEMMA2_WINDOW if arch == "gemma2" else None) or None
    sliding = _gemma_sliding_layers(meta, layers) if window else [False] * layers
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    fields["sliding_window"] = window
    fields["layer_sliding_windows"] = tuple(window if s else None for s in sliding)
    cfg["sliding_window"] = window
    cfg["query_pre_attn_scalar"] = _gemma_query_scalar(meta, fields)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    attn_cap = meta.get("attn_logit_softcapping", _GEMMA2_ATTN_CAP if arch == "gemma2" else None)
    final_cap = meta.get("final_logit_softcapping", _GEMMA2_FINAL_CAP if arch == "gemma2" else None)
    cfg["attn_logit_softcapping"] = float(attn_cap) if attn_cap else None
    cfg["final_logit_softcapping"] = float(final_cap) if final_cap else None
    if arch == "gemma3":
        full = {"rope_theta": fields["rope_theta"], **(fields["rope_scaling"] or {"rope_type": "default"})}
        swa_theta = float(meta.get("rope.freq_base_swa", _GEMMA3_SWA_THETA))
        cfg["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta},
        }


def _gemma_sliding_layers(meta: _Meta, layers: int) -> list[bool]:
    """Which layers slide: the file's pattern (a period, or one flag per layer), else llama.cpp's default
    period; a period p makes every layer but each p-th slide."""
    key = f"{meta.arch}.attention.sliding_window_pattern"
    flags = meta.reader.array(key)
    if flags is not None:
        if len(flags) != layers:
            raise ValueError(f"{meta.path}: GGUF {key} has {len(flags)} entries for {layers} layers")
        return [bool(f) for f in flags]
    period = int(meta.get("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[meta.arch]))
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _gemma_query_scalar(meta: _Meta, fields: dict[str, Any]) -> float:
    scale = meta.get("attention.scale")
    if scale:
        return float(scale) ** -2
    if fields["num_hidden_layers"] == _GEMMA_27B_LAYERS[meta.arch]:
        return fields["hidden_size"] / fields["num_attention_heads"]
    return float(fields["head_dim"])


def _phi3_longrope(meta: _Meta) -> dict[str, Any]:
    """Phi-3's longrope as its converter writes it: the per-dimension factors as two tensors, the original
    context and (when it differs from 1) the attention factor it computed from the two lengths."""
    scaling_type = meta.get("rope.scaling.type", "longrope")
    if scaling_type not in ("longrope", "none"):
        raise meta.refuse(f"{meta.arch}.rope.scaling.type {scaling_type!r} beside longrope factors")
    original = int(meta.required("rope.scaling.original_context_length"))
    factors = {
        f"{kind}_factor": meta.reader.dequantize(meta.names[f"rope_factors_{kind}.weight"]).tolist()
        for kind in ("long", "short")
    }
    scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    scaling["factor"] = meta.get("context_length", 2048) / original
    attention = meta.get("rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _phi3_fields(meta: _Meta, fields: dict[str, Any]) -> None:
    """Partial rotary (``rope.dimension_count`` of a head) and one window on every layer (0: none)."""
    rotary = meta.get("rope.dimension_count", fields["head_dim"])
    fields["hf_config"]["partial_rotary_factor"] = rotary / fields["head_dim"]
    window = meta.get("attention.sliding_window") or None
    fields["sliding_window"] = window
    fields["layer_sliding_windows"] = (window,) * fields["num_hidden_layers"]
    fields["hf_config"]["sliding_window"] = window


def _moe_fields(meta: _Meta, fields: dict[str, Any]) -> None:
    """Experts from the stacked tensors and their keys; a layer without a router runs a dense MLP (HF's
    ``mlp_only_layers``). llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's."""
    gating = meta.get("expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise meta.refuse(f"{meta.arch}.expert_gating_func {gating} (only softmax)")
    layers, names = fields["num_hidden_layers"], meta.names
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not moe_layers:
        raise ValueError(f"{meta.path}: GGUF {meta.arch} without any expert router (ffn_gate_inp)")
    first = moe_layers[0]
    experts = names[f"blk.{first}.ffn_gate_exps.weight"].shape  # [E, moe_intermediate, hidden]
    cfg = fields["hf_config"]
    cfg["num_experts"] = int(meta.get("expert_count", experts[0]))
    cfg["num_experts_per_tok"] = int(meta.required("expert_used_count"))
    cfg["moe_intermediate_size"] = int(meta.get("expert_feed_forward_length", experts[1]))
    cfg["norm_topk_prob"] = bool(meta.get("expert_weights_norm", meta.arch == "qwen3moe"))
    cfg["mlp_only_layers"] = [i for i in range(layers) if i not in moe_layers]
    cfg["hidden_act"] = "silu"
    shared = names.get(f"blk.{first}.ffn_gate_shexp.weight")
    if shared is not None:
        cfg["shared_expert_intermediate_size"] = int(
            meta.get("expert_shared_feed_forward_length", shared.shape[0])
        )


def _granite_fields(meta: _Meta, fields: dict[str, Any]) -> None:
    """IBM's muP multipliers, written by the converter as *_scale keys."""
    cfg = fields["hf_config"]
    cfg["attention_multiplier"] = float(meta.get("attention.scale", fields["head_dim"] ** -0.5))
    cfg["embedding_multiplier"] = float(meta.get("embedding_scale", 1.0))
    cfg["residual_multiplier"] = float(meta.get("residual_scale", 1.0))
    cfg["logits_scaling"] = float(meta.get("logit_scale", 1.0))


# What llama.cpp hardcodes for gpt-oss (its OPENAI_MOE graph): the SwiGLU clamp and slope, and a
# sliding window on every even layer (swa pattern 2).
_GPT_OSS_SWIGLU_LIMIT, _GPT_OSS_SWIGLU_ALPHA = 7.0, 1.702
_MXFP4 = 39  # ggml type


def _gpt_oss_fields(meta: _Meta, fields: dict[str, Any]) -> None:
    """Experts, the alternating sliding layers and the SwiGLU constants llama.cpp fixes; MXFP4 experts
    (``gguf_mxfp4_experts``) load as the checkpoint's blocks and are dequantized like its safetensors."""
    if meta.has("expert_gating_func"):
        raise meta.refuse(f"{meta.arch}.expert_gating_func (gpt-oss softmaxes its top-k logits)")
    layers, cfg = fields["num_hidden_layers"], fields["hf_config"]
    clamp = meta.reader.array(f"{meta.arch}.swiglu_clamp_exp")
    if clamp is not None and any(float(c) != _GPT_OSS_SWIGLU_LIMIT for c in clamp):
        raise meta.refuse(
            f"{meta.arch}.swiglu_clamp_exp {list(clamp)} (llama.cpp runs {_GPT_OSS_SWIGLU_LIMIT})"
        )
    stacks = _GptOssExperts.stack_types(meta)
    cfg["num_local_experts"] = int(meta.get("expert_count", stacks.experts))
    cfg["num_experts_per_tok"] = int(meta.required("expert_used_count"))
    fields["intermediate_size"] = int(meta.get("expert_feed_forward_length", stacks.intermediate))
    cfg["intermediate_size"] = fields["intermediate_size"]
    cfg["swiglu_limit"], cfg["swiglu_alpha"] = _GPT_OSS_SWIGLU_LIMIT, _GPT_OSS_SWIGLU_ALPHA
    cfg["gguf_mxfp4_experts"] = stacks.mxfp4
    window = meta.get("attention.sliding_window") or None
    sliding = [window is not None and i % 2 == 0 for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    cfg["sliding_window"] = window
    fields["sliding_window"] = window
    fields["layer_sliding_windows"] = tuple(window if s else None for s in sliding)


_FAMILY_FIELDS = {
    "gpt-oss": _gpt_oss_fields,
    "gemma2": _gemma_fields,
    "gemma3": _gemma_fields,
    "phi3": _phi3_fields,
    "qwen2moe": _moe_fields,
    "qwen3moe": _moe_fields,
    "granite": _granite_fields,
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown (or an
    expert stack, which `iter_gguf_weights` splits itself)."""
    m = _BLOCK_RE.match(gguf_name)
    names = GGUF_FAMILIES[arch].layer_names
    if m:
        layer, part, kind = m.groups()
        if part not in names:
            return None
        module = f"model.layers.{layer}.{names[part]}"
        return module if names[part] in _BARE_PARAMS else f"{module}.{kind}"
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
    """Yield (HF name, tensor) for every tensor, as the Hugging Face checkpoint holds it: q / k rows
    un-permuted, Gemma's norms back to w, expert stacks split per expert. A `QuantizedTensor` for the 2-D
    weights whose blocks stay quantized (with ``keep_quantized``), float32 for every other one."""
    # A reader of its own, not open_gguf's shared one: unmapped once every tensor is copied out, so the
    # file's pages do not stay resident beside the weights made from them.
    reader = GGUFFile(path)
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch)
    dequantized: Counter[str] = Counter()
    stacks = _GptOssExperts(reader, dequantized) if family.stacked_experts else None
    for tensor in reader.tensors:
        m = _BLOCK_RE.match(tensor.name)
        if stacks is not None and m and m.group(2) in _GPT_OSS_EXPERTS:
            yield from stacks.add(tensor, *m.groups())
            continue
        if m and m.group(2) in _EXPERT_NAMES:
            proj = _EXPERT_NAMES[m.group(2)]
            yield from _expert_weights(reader, tensor, m.group(1), proj, keep_quantized, dequantized)
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            continue  # e.g. rope_freqs: not a module weight
        fix = _row_fix(family, name, num_heads, num_kv_heads)
        quantized = gguf_quantized(reader.raw(tensor), tensor.ggml_type) if keep_quantized else None
        if quantized is not None:
            yield name, quantized if fix is None else quantized.map_rows(fix)
            continue
        array = _dense(reader, tensor, dequantized)
        array = array if fix is None else fix(array)
        if family.norm_plus_one and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1)
        yield name, _tensor(array)
    if stacks is not None:
        stacks.check_complete(path)
    reader.close()
    if dequantized:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items()))
        logger.info(
            "GGUF: dequantized %s tensor(s) at load (kept quantized: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)",
            kinds,
        )


def _row_fix(family: GGUFFamily, name: str, num_heads: int, num_kv_heads: int):
    """The row permutation that undoes the converter's q / k interleaving (weights and biases), if any."""
    if not family.permuted_qk:
        return None
    if ".q_proj." in name:
        return functools.partial(unpermute_qk, n_head=num_heads)
    if ".k_proj." in name:
        return functools.partial(unpermute_qk, n_head=num_kv_heads)
    return None


def _dense(reader: GGUFFile, tensor: Any, dequantized: Counter[str]) -> np.ndarray:
    if tensor.ggml_type not in _FLOAT_TYPES:
        dequantized[_type_name(tensor.ggml_type)] += 1
    return reader.dequantize(tensor)


def _expert_weights(
    reader: GGUFFile, tensor: Any, layer: str, proj: str, keep_quantized: bool, dequantized: Counter[str]
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """One stacked [E, out, in] expert tensor as the per-expert tensors of an HF checkpoint: each expert's
    rows a `QuantizedTensor` where the block type stays quantized, else float32."""
    names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(tensor.shape[0])]
    if keep_quantized and tensor.ggml_type in _KEPT_TYPES:
        raw = reader.raw(tensor)
        for e, name in enumerate(names):
            yield name, gguf_quantized(raw[e], tensor.ggml_type)
        return
    stack = _dense(reader, tensor, dequantized)
    for e, name in enumerate(names):
        yield name, _tensor(stack[e])


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


@dataclass(frozen=True)
class _StackTypes:
    experts: int
    intermediate: int
    mxfp4: bool


class _GptOssExperts:
    """gpt-oss's expert stacks back in its checkpoint's layout (`tokenos.models.gpt_oss.GptOssExperts`
    loads that): ``gate_up_proj`` ``[E, H, 2I]`` with gate and up rows interleaved, ``down_proj``
    ``[E, I, H]``, biases ``[E, 2I]`` / ``[E, H]``; MXFP4 stacks as ``*_blocks`` ``[E, out, in / 32, 16]`` and
    ``*_scales`` ``[E, out, in / 32]``. The converter writes gate and up as two stacks (or one fused
    ``ffn_gate_up_exps``, gate rows first), so a layer's gate is held until its up is read."""

    def __init__(self, reader: GGUFFile, dequantized: Counter[str]) -> None:
        self.reader, self.dequantized = reader, dequantized
        self.pending: dict[tuple[str, str], dict[str, Any]] = {}

    @staticmethod
    def stack_types(meta: _Meta) -> _StackTypes:
        """Expert count, intermediate size and whether every expert weight stack is MXFP4 (a file that
        mixes MXFP4 with other types is refused: the experts dequantize all together or not at all)."""
        weights = [
            t
            for name, t in meta.names.items()
            if (m := _BLOCK_RE.match(name)) and m.group(2) in _GPT_OSS_EXPERTS and m.group(3) == "weight"
        ]
        if not weights:
            raise ValueError(f"{meta.path}: GGUF gpt-oss without expert stacks (ffn_*_exps)")
        mxfp4 = {t.ggml_type == _MXFP4 for t in weights}
        if len(mxfp4) > 1:
            raise meta.refuse("gpt-oss expert stacks partly in MXFP4 and partly in other block types")
        gate = meta.names.get("blk.0.ffn_gate_exps.weight")
        if gate is not None:
            return _StackTypes(gate.shape[0], gate.shape[1], mxfp4.pop())
        fused = meta.names["blk.0.ffn_gate_up_exps.weight"]
        return _StackTypes(fused.shape[0], fused.shape[1] // 2, mxfp4.pop())

    def add(self, tensor: Any, layer: str, part: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this GGUF tensor completes (none while a layer's gate waits for up)."""
        prefix = f"model.layers.{layer}.mlp.experts."
        values = self._values(tensor, kind)
        if part == "ffn_down_exps":
            yield from self._down(prefix, kind, values)
        elif part == "ffn_gate_up_exps":
            yield from self._gate_up(prefix, kind, *self._halves(values))
        else:
            slot = self.pending.setdefault((layer, kind), {})
            slot[part] = values
            if len(slot) == 2:
                del self.pending[(layer, kind)]
                yield from self._gate_up(prefix, kind, slot["ffn_gate_exps"], slot["ffn_up_exps"])

    def check_complete(self, path: str) -> None:
        if self.pending:
            missing = ", ".join(f"blk.{layer} {kind}" for layer, kind in sorted(self.pending))
            raise ValueError(
                f"{path}: GGUF gpt-oss has a gate or up expert stack without the other: {missing}"
            )

    def _values(self, tensor: Any, kind: str) -> Any:
        """float32 values, or an MXFP4 weight's (blocks, scales) in the checkpoint's layout."""
        if kind == "weight" and tensor.ggml_type == _MXFP4:
            return _mxfp4_checkpoint_blocks(self.reader.raw(tensor))
        return _dense(self.reader, tensor, self.dequantized)

    @staticmethod
    def _halves(values: Any) -> tuple[Any, Any]:
        """A fused stack's gate rows and up rows (the converter concatenates them along the rows)."""
        if isinstance(values, tuple):
            (blocks_g, blocks_u), (scales_g, scales_u) = (np.split(v, 2, axis=1) for v in values)
            return (blocks_g, scales_g), (blocks_u, scales_u)
        return tuple(np.split(values, 2, axis=1))

    def _down(self, prefix: str, kind: str, values: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if kind == "bias":
            yield f"{prefix}down_proj_bias", _tensor(values)
        elif isinstance(values, tuple):
            yield f"{prefix}down_proj_blocks", _tensor(values[0])
            yield f"{prefix}down_proj_scales", _tensor(values[1])
        else:
            yield f"{prefix}down_proj", _tensor(values.transpose(0, 2, 1))  # [E, H, I] -> [E, I, H]

    def _gate_up(self, prefix: str, kind: str, gate: Any, up: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if kind == "bias":
            yield f"{prefix}gate_up_proj_bias", _tensor(_interleave(gate, up))
        elif isinstance(gate, tuple):
            yield f"{prefix}gate_up_proj_blocks", _tensor(_interleave(gate[0], up[0]))
            yield f"{prefix}gate_up_proj_scales", _tensor(_interleave(gate[1], up[1]))
        else:
            yield f"{prefix}gate_up_proj", _tensor(_interleave(gate, up).transpose(0, 2, 1))  # [E, H, 2I]


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[E, I, ...]`` gate and up rows -> ``[E, 2I, ...]`` as ``g0, u0, g1, u1, ...`` (the checkpoint's)."""
    return np.stack((gate, up), axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def _mxfp4_checkpoint_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows ``[..., rows, blocks * 17]`` -> the checkpoint's uint8 (blocks ``[..., rows, G, 16]``,
    scales ``[..., rows, G]``). Both hold the same e2m1 codes and e8m0 exponents (ggml's table is the e2m1
    values doubled and its scale halved); only the nibble order differs: ggml puts value j in the low and
    j + 16 in the high nibble of byte j, the checkpoint values 2k and 2k + 1 in byte k."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1)  # [..., G, 32] in value order
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(scales)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch tensor owning writable memory: uint8 (MXFP4 blocks) as it is, everything else float32."""
    if array.dtype == np.uint8:
        return torch.from_numpy(np.array(array, copy=True))
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
