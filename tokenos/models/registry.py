"""The one architecture registry: Hugging Face architecture name -> our model class.

An entry names the module and class that implement an architecture (imported only when a model is
built, so resolving a config stays light) and the config defaults that tell it apart from its family's
base (Qwen2's q/k/v bias, Qwen3's q/k norm). `tokenos.models.config` validates a checkpoint's
architecture against this table; GGUF files map their own architecture names onto it in
`tokenos.model_loader.gguf_loader`. An architecture it lacks may still run on the transformers backend
(`resolve_model_impl`, `tokenos.models.transformers_backend`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Architecture:
    module: str  # under tokenos.models
    class_name: str
    # ModelConfig fields this architecture implies unless the checkpoint says otherwise.
    defaults: dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"attention_bias": True}),
    "Qwen3ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"qk_norm": True}),
    "Qwen2MoeForCausalLM": Architecture("qwen_moe", "Qwen2MoeForCausalLM", {"attention_bias": True}),
    "Qwen3MoeForCausalLM": Architecture("qwen_moe", "Qwen3MoeForCausalLM", {"qk_norm": True}),
    "Olmo2ForCausalLM": Architecture("olmo2", "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": Architecture("phi3", "Phi3ForCausalLM"),
    # Gemma configs may leave tie_word_embeddings out: transformers' default for them is True.
    "Gemma2ForCausalLM": Architecture("gemma", "Gemma2ForCausalLM", {"tie_word_embeddings": True}),
    "Gemma3ForCausalLM": Architecture(
        "gemma", "Gemma3ForCausalLM", {"tie_word_embeddings": True, "qk_norm": True}
    ),
    "GraniteForCausalLM": Architecture("granite", "GraniteForCausalLM"),
    "Mamba2ForCausalLM": Architecture("mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": Architecture("bamba", "BambaForCausalLM"),
    "Qwen3NextForCausalLM": Architecture("qwen3_next", "Qwen3NextForCausalLM"),
    "GraniteMoeHybridForCausalLM": Architecture("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "FalconH1ForCausalLM": Architecture("falcon_h1", "FalconH1ForCausalLM"),
    "NemotronHForCausalLM": Architecture("nemotron_h", "NemotronHForCausalLM"),
    "GptOssForCausalLM": Architecture("gpt_oss", "GptOssForCausalLM", {"attention_bias": True}),
    "DeepseekV2ForCausalLM": Architecture("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": Architecture("deepseek", "DeepseekV3ForCausalLM"),
}


def get_architecture(name: str) -> Architecture:
    """The registry entry of `name`; ValueError naming the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"Unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        ) from None


def resolve_model_impl(name: str, model_impl: str = "auto") -> str:
    """Which code runs `name`: "tokenos" (a native class here) or "transformers" (the transformers backend,
    `tokenos.models.transformers_backend`). "auto" prefers the native class and falls back to the backend
    for a causal LM transformers knows; "tokenos" (or vLLM's "vllm") insists on native code; "transformers"
    takes the backend for every architecture. ValueError when nothing runs it."""
    choice = str(model_impl).lower()
    if choice == "transformers":
        return "transformers"
    if choice not in ("auto", "tokenos", "vllm"):
        raise ValueError(f"model_impl={model_impl!r}: choose auto, tokenos (alias vllm) or transformers")
    if name in ARCHITECTURES or choice != "auto":
        get_architecture(name)  # ValueError for an unknown architecture, as without a backend
        return "tokenos"
    from tokenos.models.transformers_backend import transformers_causal_lm_architectures

    if name in transformers_causal_lm_architectures():
        return "transformers"
    raise ValueError(
        f"Unsupported architecture {name!r}: neither tokenos nor transformers implements it; "
        f"supported: {', '.join(ARCHITECTURES)} and transformers' causal LMs (the transformers backend)"
    )


def model_class(name: str) -> type[nn.Module]:
    entry = get_architecture(name)
    module = importlib.import_module(f"tokenos.models.{entry.module}")
    return getattr(module, entry.class_name)
