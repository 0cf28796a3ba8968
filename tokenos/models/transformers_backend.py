"""The transformers backend (``--model-impl transformers``): a transformers ``*ForCausalLM`` on our
scheduler, paged pool and sampler.

Idea (vLLM's transformers backend, and transformers' own continuous batching): transformers builds and
loads the model; its attention layers call whatever function ``config._attn_implementation`` names in
its ``AttentionInterface`` registry, so we register one (``"tokenos_paged"``) that hands q / k / v to a
tokenos `Attention` cache layer attached to each transformers attention module. That layer writes this
step's K/V into its pages and attends over each request's cached context, exactly as in our native
models. The whole step is one sequence of ``T`` tokens (``input_ids [1, T]``, ``position_ids`` from
the batch), so transformers' rotary sees each token's own position; it builds no mask for an
implementation its mask registry does not know, and our paged attention keeps each request causal and
apart.

What a model needs: its transformers class says ``_supports_attention_backend`` (its attention goes
through the registry and forwards our keyword arguments to it), every decoder layer is full or
sliding-window attention with K and V of one head size (no multi-head latent attention), and it is
decoder-only. Anything else is refused at config time with a
ValueError. The LM head is the model's output embeddings; the logit transforms a ``*ForCausalLM`` applies
after it (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma's final soft cap) are repeated in
`compute_logits`, and at load both paths run on a few tokens (transformers' eager attention): a model
whose forward transforms the LM head's output any other way is refused, never served with wrong logits.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenos.layers.attention import Attention
from tokenos.layers.metadata import ForwardBatch, bind_cache_layers
from tokenos.models.base import PagedModel

if TYPE_CHECKING:
    from tokenos.models.config import ModelConfig

ATTN_IMPLEMENTATION = "tokenos_paged"
# The keyword that carries the step's ForwardBatch through transformers' forward to the attention function.
BATCH_KWARG = "tokenos_batch"
ATTACHED_NAME = "paged_attn"  # the tokenos Attention registered inside each transformers attention module
_ATTENTION_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def transformers_causal_lm_architectures() -> set[str]:
    """Every ``*ForCausalLM`` class name transformers' auto mapping knows."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def require_causal_lm(architecture: str) -> None:
    """ValueError unless transformers has ``architecture`` as a causal LM (checked before its config is
    parsed, which would fail less clearly)."""
    import transformers

    if architecture not in transformers_causal_lm_architectures():
        raise ValueError(
            f"{architecture!r} is not a causal LM transformers {transformers.__version__} knows; the "
            "transformers backend builds only transformers' own *ForCausalLM classes"
        )


def check_supported(architecture: str, hf_config: Any) -> None:
    """ValueError, saying what to do, unless the backend can page ``architecture``'s attention."""
    import transformers

    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{architecture} is an encoder-decoder model; tokenos runs decoder-only models")
    if not getattr(transformers, architecture).is_backend_compatible():
        raise ValueError(
            f"transformers' {architecture} does not route its attention through the AttentionInterface "
            "registry (_supports_attention_backend is False), so tokenos cannot page its KV cache; use an "
            "architecture with a native implementation (tokenos.models.registry.ARCHITECTURES)"
        )
    if getattr(hf_config, "kv_lora_rank", None):
        raise ValueError(
            f"{architecture} uses multi-head latent attention (K and V of different head sizes), which "
            "tokenos's attention pages do not hold; it needs a native implementation"
        )
    other = sorted(set(getattr(hf_config, "layer_types", None) or ()) - set(_ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(
            f"{architecture} has {', '.join(other)} layers; the transformers backend pages attention only "
            "(recurrent and other layer kinds need a native implementation)"
        )


def _check_model_type(architecture: str, model_type: str) -> None:
    """transformers builds the class its auto mapping gives ``model_type``; refuse a config whose
    ``architectures`` names another, rather than run a model the checkpoint does not describe."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if built != architecture:
        raise ValueError(
            f"config.json names {architecture} but its model_type {model_type!r} builds {built} in "
            "transformers; fix the config's architectures or model_type"
        )


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's attention window: ``layer_types`` says which layers slide, else the config's one
    ``sliding_window`` (or none) holds for every layer. The attention function checks it per call."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return tuple(window if _ATTENTION_LAYER_TYPES[t] else None for t in layer_types)
    return (window,) * hf_config.num_hidden_layers


def model_config_fields(folder: str, architecture: str) -> dict[str, Any]:
    """`ModelConfig` fields of the checkpoint in ``folder``, read through transformers' own config class
    (so each family's field names and defaults are transformers'); ValueError if unsupported."""
    from transformers import AutoConfig

    require_causal_lm(architecture)
    config = AutoConfig.from_pretrained(folder)
    _check_model_type(architecture, config.model_type)
    hf_config = config.get_text_config()
    check_supported(architecture, hf_config)
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    heads = hf_config.num_attention_heads
    windows = layer_sliding_windows(hf_config)
    return {
        "architecture": architecture,
        "model_impl": "transformers",
        "hidden_size": hf_config.hidden_size,
        "intermediate_size": getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        "vocab_size": hf_config.vocab_size,
        # Norms and rotary run inside transformers' modules: these three are informational only.
        "rms_norm_eps": _norm_eps(hf_config),
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": getattr(hf_config, "max_position_embeddings", None) or 2048,
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "sliding_window": next((w for w in windows if w is not None), None),
        "layer_sliding_windows": windows,
        "eos_token_ids": _id_tuple(raw.get("eos_token_id")),
        "bos_token_id": raw.get("bos_token_id"),
        "hf_config": raw,
    }


def _norm_eps(hf_config: Any) -> float:
    return getattr(hf_config, "rms_norm_eps", None) or getattr(hf_config, "layer_norm_eps", None) or 1e-6


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our paged pool: q [1, H, T, D], k / v
    [1, KVH, T, D] (one flattened step) -> ([1, T, H, D], no weights). The module's attached `Attention`
    writes k / v into its pages and attends; every setting transformers passes is checked against what
    that layer declared to the KV-cache manager (a mismatch would silently change the results); the softmax
    scale is the call's."""
    batch: ForwardBatch | None = kwargs.get(BATCH_KWARG)
    layer: Attention | None = getattr(module, ATTACHED_NAME, None)
    if batch is None or layer is None:
        raise RuntimeError(
            f"the {ATTN_IMPLEMENTATION!r} attention runs only inside tokenos's TransformersCausalLM.forward"
        )
    unknown = sorted(set(kwargs) - _BENIGN_KWARGS)
    if unknown:  # something that shapes the attention (sinks, a custom mask) would be silently dropped
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION!r} attention does not take {', '.join(unknown)}")
    _check_call(module, layer, query, key, value, sliding_window, softcap, dropout)
    if scaling is not None:  # the call's: OPT scales q itself and passes 1.0; no page depends on it
        layer.scale = scaling
    num_tokens = query.shape[2]
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]: the layout the C prefill kernel reads
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = layer(q, k, v, batch)
    return out.view(1, num_tokens, layer.num_heads, layer.head_size), None


def _check_call(
    module: nn.Module,
    layer: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    dropout: float,
) -> None:
    where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if query.shape[0] != 1 or query.shape[1] != layer.num_heads or key.shape[1] != layer.num_kv_heads:
        raise RuntimeError(
            f"{where}: q {tuple(query.shape)} / k {tuple(key.shape)} do not match the declared "
            f"{layer.num_heads} heads / {layer.num_kv_heads} KV heads of {layer.head_size}"
        )
    if query.shape[-1] != layer.head_size or value.shape[-1] != layer.head_size:
        raise RuntimeError(
            f"{where}: q / v head sizes {query.shape[-1]} / {value.shape[-1]}, declared {layer.head_size}"
        )
    if sliding_window != layer.sliding_window:
        raise RuntimeError(f"{where}: sliding window {sliding_window}, declared {layer.sliding_window}")
    if softcap != layer.logit_softcap:
        raise RuntimeError(f"{where}: attention soft cap {softcap}, declared {layer.logit_softcap}")
    if dropout:
        raise RuntimeError(f"{where}: attention dropout {dropout} (the model must be in eval mode)")


# What transformers' attention modules pass that does not change the attention's result.
_BENIGN_KWARGS = frozenset({BATCH_KWARG, "position_ids", "use_cache", "cache_position", "output_attentions"})


def _refuse_own_attention_parameters(modules: list[nn.Module], architecture: str) -> None:
    """An attention module's own parameters (beside its projections and norms) feed the attention math
    itself, as gpt-oss's ``sinks`` do; the paged layer would leave them out, so the model is refused."""
    own = sorted({name for m in modules for name, _ in m.named_parameters(recurse=False)})
    if own:
        raise ValueError(
            f"{architecture}'s attention has its own parameters ({', '.join(own)}: attention sinks or the "
            "like) that tokenos's paged attention does not compute; it needs a native implementation"
        )


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def _attention_modules(hf_model: nn.Module, num_layers: int) -> list[nn.Module]:
    """The transformers attention module of each decoder layer, by ``layer_idx``; ValueError unless
    there is exactly one per layer (the only layout whose attention we can attach to)."""
    found: dict[int, nn.Module] = {}
    for name, m in hf_model.named_modules():
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int):
            if m.layer_idx in found:
                raise ValueError(f"two attention modules claim layer {m.layer_idx} (the second: {name})")
            found[m.layer_idx] = m
    if sorted(found) != list(range(num_layers)):
        raise ValueError(
            f"found attention modules for layers {sorted(found)}, expected one for each of {num_layers}"
        )
    return [found[i] for i in range(num_layers)]


class TransformersCausalLM(PagedModel):
    """A transformers ``*ForCausalLM`` with one tokenos `Attention` per decoder layer, behind the three
    calls every tokenos model has (`tokenos.models.base.CausalLM`'s contract)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if config.quantization is not None:
            raise ValueError(
                f"the transformers backend loads dense weights only; quantization={config.quantization!r} "
                "needs a native implementation"
            )
        _register_attention()
        self.config = config
        self.hf = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=config.dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).eval()
        hf_config = self.hf.config.get_text_config()
        modules = _attention_modules(self.hf, config.num_hidden_layers)
        _refuse_own_attention_parameters(modules, config.architecture)
        for module, window in zip(modules, config.layer_sliding_windows, strict=True):
            module.add_module(ATTACHED_NAME, self._attention_for(module, hf_config, window))
        self._cache_layers = bind_cache_layers(self)
        self._check_logits_path()

    @torch.inference_mode()
    def _check_logits_path(self) -> None:
        """Refuse a model whose ``*ForCausalLM.forward`` does to the LM head's output something
        `compute_logits` does not repeat (it would serve wrong logits silently): both paths on a few tokens,
        with transformers' own eager attention for once."""
        ids = torch.arange(1, min(9, self.config.vocab_size)).unsqueeze(0)
        self.hf.set_attn_implementation("eager")
        try:
            want = self.hf(input_ids=ids, use_cache=False).logits[0].float()
            got = self.compute_logits(self.hf.base_model(input_ids=ids, use_cache=False).last_hidden_state[0])
        finally:
            self.hf.set_attn_implementation(ATTN_IMPLEMENTATION)
        tolerance = 1e-3 * max(float(want.abs().max()), 1.0)
        if got.shape != want.shape or float((got - want).abs().max()) > tolerance:
            raise ValueError(
                f"{self.config.architecture}'s forward transforms the LM head's output in a way the "
                "transformers backend does not repeat, so its logits would be wrong; it needs a native "
                "implementation"
            )

    def _attention_for(self, module: nn.Module, hf_config: Any, window: int | None) -> Attention:
        """Our paged layer for one transformers attention module, shaped as the module computes: a config
        may carry fields its family ignores (a GPT-NeoX config keeps a stray num_key_value_heads), so the
        module's own head size and GQA groups are what count (a module without groups is multi-head).
        `paged_attention_forward` checks every call against these."""
        heads = hf_config.num_attention_heads
        head_size = (
            getattr(module, "head_dim", None) or getattr(module, "head_size", None) or self.config.head_dim
        )
        kv_heads = heads // getattr(module, "num_key_value_groups", 1)
        scale = getattr(module, "scaling", None) or head_size**-0.5
        softcap = getattr(hf_config, "attn_logit_softcapping", None)
        return Attention(heads, kv_heads, head_size, scale, window, softcap)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm, for one step."""
        out = self.hf.base_model(
            input_ids=batch.input_ids.unsqueeze(0),
            position_ids=batch.positions.unsqueeze(0),
            use_cache=False,
            **{BATCH_KWARG: batch},
        )
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]``: the output embeddings, then the ``*ForCausalLM``'s own scaling."""
        logits = self.hf.get_output_embeddings()(hidden).float()
        hf_config = self.hf.config.get_text_config()
        if (scale := getattr(hf_config, "logit_scale", None)) is not None:  # Cohere
            logits = logits * scale
        if (divisor := getattr(hf_config, "logits_scaling", None)) is not None:  # Granite
            logits = logits / divisor
        if (cap := getattr(hf_config, "final_logit_softcapping", None)) is not None:  # Gemma
            logits = torch.tanh(logits / cap) * cap
        return logits
