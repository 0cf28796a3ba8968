"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's norms, scales and soft caps.

What sets them apart from `tokenos.models.llama` (transformers' ``modeling_gemma2`` / ``modeling_gemma3``
are the reference):

- RMSNorm scales by ``1 + weight`` in float32 (`GemmaRMSNorm`), and every layer has four of them: before
  and after attention, before and after the MLP (the post-norms apply to the sublayer's output, before
  it joins the residual stream);
- the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype, the MLP gate is
  GELU (tanh), the softmax scale is ``query_pre_attn_scalar ** -0.5``, the LM head is tied;
- ``layer_types`` alternate sliding-window and full attention (the windows come from
  `tokenos.models.config`, so the KV-cache coordinator puts the two kinds in separate groups);
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``: the C attention kernels of
  `tokenos.layers.attention`, its explicit torch attention where they do not run) and the final logits
  (``final_logit_softcapping``);
- Gemma 3 RMS-norms q and k per head (``1 + weight`` too) before rotary, and rotates sliding layers with
  their own base (``rope_local_base_freq``) and full layers with ``rope_theta`` and the config's scaling:
  one table per layer type, gathered once per step (`PerTypeRotary`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers.activation import GeluTanhAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import GemmaRMSNorm
from tokenos.layers.linear import Linear
from tokenos.layers.metadata import ForwardBatch
from tokenos.layers.rotary import Rope, RotaryEmbedding
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig, rope_for_layer_type
from tokenos.models.llama import DecoderAttention, DecoderMLP

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: ModelConfig) -> list[str]:
    """Each layer's type, as transformers names them: the config's ``layer_types`` when it has them (the
    rotary base follows the type even where no window is set), else from the resolved windows."""
    types = config.hf_config.get("layer_types")
    if types and len(types) == config.num_hidden_layers:
        return list(types)
    return [FULL if w is None else SLIDING for w in config.layer_sliding_windows]


class GemmaEmbedding(VocabEmbedding):
    """Embeddings times ``sqrt(hidden_size)``, the factor rounded to the table's dtype first (as
    transformers' ``Gemma2TextScaledWordEmbedding`` does: in bf16 the factor itself is rounded)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = hidden_size**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * torch.tensor(self.scale, dtype=x.dtype)


class PerTypeRotary(nn.Module):
    """One RoPE table per layer type (Gemma 3); ``cos_sin`` gathers each once per step and returns
    them by type, and every layer picks its own."""

    def __init__(self, rotaries: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(rotaries)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        return {name: rotary.cos_sin(positions, dtype) for name, rotary in self.tables.items()}


class GemmaAttention(DecoderAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary, sliding_window)
        cfg = config.hf_config
        scale = float(cfg.get("query_pre_attn_scalar", self.head_dim)) ** -0.5
        softcap = cfg.get("attn_logit_softcapping")  # Gemma 2 only; None in Gemma 3
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale,
            sliding_window,
            None if softcap is None else float(softcap),
        )
        if config.qk_norm:  # Gemma 3: per-head q / k norms, Gemma's (1 + w) kind
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        if config.attention_bias:  # Gemma's attention_bias covers o_proj too (Qwen2's only q/k/v)
            self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=True)


class GemmaMLP(DecoderMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.act = GeluTanhAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None, layer_type: str
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, rotary, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        rope: Rope | dict[str, Rope],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(rope, dict):  # PerTypeRotary's step tables
            rope = rope[self.layer_type]
        # The stream arrives as (last sublayer's post-normed output, residual); the final norm adds them.
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(h), batch))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h


class GemmaModel(DecoderStack):
    """``per_type_rope``: one rotary table per layer type (Gemma 3), else one for all (Gemma 2)."""

    def __init__(self, config: ModelConfig, per_type_rope: bool) -> None:
        types = layer_types(config)
        if per_type_rope:
            tables = {
                t: RotaryEmbedding(
                    config.head_dim, config.max_model_len, *rope_for_layer_type(config.hf_config, t)
                )
                for t in sorted(set(types))
            }
            rotary: nn.Module = PerTypeRotary(tables)
        else:
            one = RotaryEmbedding(
                config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
            )
            rotary, tables = one, dict.fromkeys(types, one)
        layers = [
            GemmaDecoderLayer(config, tables[t], window, t)
            for t, window in zip(types, config.layer_sliding_windows, strict=True)
        ]
        super().__init__(
            ("embed_tokens", GemmaEmbedding(config.vocab_size, config.hidden_size)),
            layers,
            ("norm", GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


def _check_supported(config: ModelConfig) -> None:
    cfg = config.hf_config
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not supported (Gemma: only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma: use_bidirectional_attention=True (an encoder) is not supported")


class _GemmaForCausalLM(CausalLM):
    packed_modules_mapping = FUSED_QKV_GATE_UP
    per_type_rope = False

    def __init__(self, config: ModelConfig) -> None:
        _check_supported(config)
        super().__init__(config, "model", GemmaModel(config, self.per_type_rope))
        cap = config.hf_config.get("final_logit_softcapping")
        self.final_logit_softcap = None if cap is None else float(cap)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(_GemmaForCausalLM):
    """Gemma 2: attention and final-logit soft caps, alternating sliding / full layers."""


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """Gemma 3 text: q / k norms, per-layer-type rotary, five sliding layers to a full one by default."""

    per_type_rope = True
