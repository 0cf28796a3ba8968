"""gpt-oss (OpenAI gpt-oss-20b / 120b): a Llama-shaped decoder with attention sinks and a biased MoE.

What sets it apart from `tokenos.models.llama` (transformers' ``modeling_gpt_oss`` is the reference):

- every attention projection has a bias (q / k / v and o), and each query head has a learned sink logit
  (``self_attn.sinks``) that joins its softmax denominator (in the C attention kernels, or
  `tokenos.layers.attention`'s explicit path);
- ``layer_types`` alternate sliding-window and full attention (the windows come from
  `tokenos.models.config`, so the KV-cache coordinator puts the two kinds in separate groups);
- every feed-forward is a MoE: a biased router (``mlp.router``), top-k of its logits, softmax over the k
  chosen logits only; experts with biases, ``gate_up`` interleaved ``[g0, u0, g1, u1, ...]``, gate clamped
  above and up on both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``.

Checkpoints hold the experts stacked and transposed relative to ``nn.Linear`` (``experts.gate_up_proj``
``[E, H, 2I]``, ``experts.down_proj`` ``[E, I, H]``, biases ``[E, 2I]`` / ``[E, H]``); the loaders transpose
them and split the interleaved gate / up into halves once, so each expert runs as two ``F.linear`` calls.
MXFP4 checkpoints (the released ones: ``experts.{gate_up,down}_proj_blocks`` / ``_scales``, everything
else dense) load their experts as uint8 and dequantize them (`tokenos.layers.mxfp4`, lossless) in
``pack``, into the same stacked layout as a dense save; no kernel computes on MXFP4 itself. Real
checkpoints use yarn rope scaling (`tokenos.layers.rotary`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenos.layers.attention import Attention
from tokenos.layers.embedding import VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, _upcast_linear
from tokenos.layers.mxfp4 import BLOCK, dequantize_mxfp4
from tokenos.layers.quantization import ONLINE_METHODS, QuantizedWeight, quantize
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.layers.weights import make_param
from tokenos.models.base import FUSED_QKV_GATE_UP, CausalLM, DecoderStack
from tokenos.models.config import ModelConfig
from tokenos.models.llama import DecoderAttention, DecoderLayer
from tokenos.models.qwen_moe import grouped_experts
from tokenos.platform import native_bf16_supported

SLIDING, FULL = "sliding_attention", "full_attention"


def _biased_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as `Linear` on its plain path: bf16 is upcast where the CPU only emulates it.
    if x.dtype == torch.bfloat16 and not native_bf16_supported():
        return _upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _check_shape(loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)}, expected {shape}")


class GptOssExperts(nn.Module):
    """``num_experts`` clamped-SwiGLU MLPs with biases, stacked in ``F.linear`` layout: ``gate_up_proj``
    ``[E, 2I, H]`` (gate rows, then up rows), ``down_proj`` ``[E, H, I]``; parameter names are the
    checkpoint's. ``mxfp4``: the weights load as the checkpoint's uint8 ``*_blocks`` / ``*_scales`` instead
    and become those two stacked weights in ``pack``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
        dtype: torch.dtype,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = alpha, limit
        self.dtype = dtype
        self.gate_up_proj_bias = make_param(num_experts, 2 * intermediate_size, dtype=dtype)
        self.down_proj_bias = make_param(num_experts, hidden_size, dtype=dtype)
        self.gate_up_proj_bias.weight_loader = self._load_gate_up_bias
        self.mxfp4 = mxfp4
        if mxfp4:
            self._mxfp4_params("gate_up_proj", 2 * intermediate_size, hidden_size)
            self._mxfp4_params("down_proj", hidden_size, intermediate_size)
        else:
            self.gate_up_proj = make_param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
            self.down_proj = make_param(num_experts, hidden_size, intermediate_size, dtype=dtype)
            self.gate_up_proj.weight_loader = self._load_gate_up
            self.down_proj.weight_loader = self._load_down
        # Per expert, once quantized online (`pack`): name -> [expert] -> its weight.
        self.quantized: dict[str, list[QuantizedWeight]] = {}

    def _mxfp4_params(self, name: str, rows: int, cols: int) -> None:
        if cols % BLOCK:
            raise ValueError(f"MXFP4 experts: {name} rows of {cols} values are not whole blocks of {BLOCK}")
        blocks = (self.num_experts, rows, cols // BLOCK)
        setattr(self, f"{name}_blocks", make_param(*blocks, BLOCK // 2, dtype=torch.uint8))
        setattr(self, f"{name}_scales", make_param(*blocks, dtype=torch.uint8))

    def _dequantize(self) -> None:
        """MXFP4 -> the dense stacked weights (gate_up's rows de-interleaved), the uint8 copies dropped."""
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
            w = dequantize_mxfp4(blocks.data, scales.data, self.dtype)  # [E, out, in]: F.linear's layout
            if name == "gate_up_proj":
                w = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)
            delattr(self, f"{name}_blocks")
            delattr(self, f"{name}_scales")
            setattr(self, name, nn.Parameter(w, requires_grad=False))
        self.mxfp4 = False

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        _check_shape(loaded, (e, h, 2 * i), "experts.gate_up_proj")
        rows = loaded.transpose(1, 2)  # [E, 2I, H], rows interleaved gate / up
        param.data.copy_(torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1))

    def _load_gate_up_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(loaded, (self.num_experts, 2 * self.intermediate_size), "experts.gate_up_proj_bias")
        param.data.copy_(torch.cat((loaded[:, 0::2], loaded[:, 1::2]), dim=1))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        _check_shape(loaded, (e, i, h), "experts.down_proj")
        param.data.copy_(loaded.transpose(1, 2))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[chosen[t, k]](x[t])`` for x [T, H], chosen / weights [T, K]."""
        return grouped_experts(x, chosen, weights, self.num_experts, self._expert)

    def _expert(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = self._linear(h, "gate_up_proj", expert).chunk(2, dim=-1)
        return self._linear(self.act(gate, up), "down_proj", expert)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """transformers' ``_apply_gate``: the gate clamped above only, up on both sides, then ``+ 1``."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _linear(self, h: torch.Tensor, name: str, expert: int) -> torch.Tensor:
        bias = getattr(self, f"{name}_bias")[expert]
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized[expert](h, bias)
        return _biased_linear(h, getattr(self, name)[expert], bias)

    def pack(self, quantization: str | None = None) -> None:
        """With online int8 / int4 (``--quantization``), every expert's weights quantized like the other
        linears' (biases stay dense), the stacked dense copies dropped. MXFP4 experts are dequantized
        first."""
        if self.mxfp4:
            self._dequantize()
        if quantization not in ONLINE_METHODS or self.quantized:
            return
        bits = 8 if quantization == "int8" else 4
        for name in ("gate_up_proj", "down_proj"):
            self.quantized[name] = [QuantizedWeight(quantize(w, bits)) for w in getattr(self, name).detach()]
            setattr(self, name, None)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K], experts [T, K]): the top-k router logits, softmaxed among themselves in their own
    dtype (transformers' ``GptOssTopKRouter``; not a softmax over all experts)."""
    top, chosen = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1), chosen


def is_mxfp4(hf_config: dict) -> bool:
    """Whether the checkpoint stores its experts in MXFP4 (``quantization_config.quant_method``, or a GGUF
    whose expert stacks are MXFP4: ``gguf_mxfp4_experts``, set by `tokenos.model_loader.gguf_loader`)."""
    if hf_config.get("gguf_mxfp4_experts"):
        return True
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    return str(method).lower() == "mxfp4"


class GptOssRMSNorm(RMSNorm):
    """RMSNorm whose weight multiply stays in float32, rounding once (transformers' ``GptOssRMSNorm``; the
    same in float32, one rounding fewer in bf16)."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class GptOssMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.hf_config
        experts = int(cfg["num_local_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.router = Linear(config.hidden_size, experts, bias=True)
        self.experts = GptOssExperts(
            experts,
            config.hidden_size,
            config.intermediate_size,
            float(cfg.get("swiglu_alpha", 1.702)),
            float(cfg.get("swiglu_limit", 7.0)),
            config.dtype,
            is_mxfp4(cfg),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.router(x), self.top_k)
        return self.experts(x, chosen, weights.to(x.dtype))


class GptOssAttention(DecoderAttention):
    """Llama's attention with every projection biased and a sink logit per query head."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__(config, rotary, sliding_window)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        # Registered here, under the checkpoint's name ``self_attn.sinks``; `Attention` reads the same tensor.
        self.sinks = make_param(self.num_heads, dtype=config.dtype)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window,
            sinks=self.sinks,
        )


class GptOssDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer (its ``forward``) with gpt-oss's attention and MoE."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        # Not DecoderLayer.__init__: it would allocate a dense MLP that gpt-oss does not have.
        nn.Module.__init__(self)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, rotary, sliding_window)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMLP(config)


class GptOssModel(DecoderStack):
    def __init__(self, config: ModelConfig) -> None:
        rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        super().__init__(
            ("embed_tokens", VocabEmbedding(config.vocab_size, config.hidden_size)),
            [GptOssDecoderLayer(config, rotary, window) for window in config.layer_sliding_windows],
            ("norm", GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)),
            rotary,
        )


def check_supported(config: ModelConfig) -> None:
    """ValueError for what this implementation does not do, instead of serving something else."""
    cfg = config.hf_config
    types = cfg.get("layer_types") or []
    if set(types) - {SLIDING, FULL}:
        raise ValueError(f"gpt-oss: layer_types {sorted(set(types) - {SLIDING, FULL})} are not supported")
    if types and len(types) != config.num_hidden_layers:
        raise ValueError(f"gpt-oss: {len(types)} layer_types for {config.num_hidden_layers} layers")
    if SLIDING in types and not cfg.get("sliding_window"):
        raise ValueError("gpt-oss: sliding_attention layers without a sliding_window")
    for key in ("num_local_experts", "num_experts_per_tok"):
        if not cfg.get(key):
            raise ValueError(f"gpt-oss: the config lacks {key}")
    if int(cfg["num_experts_per_tok"]) > int(cfg["num_local_experts"]):
        raise ValueError("gpt-oss: num_experts_per_tok exceeds num_local_experts")


class GptOssForCausalLM(CausalLM):
    """gpt-oss: attention sinks, alternating sliding / full layers, a biased top-k MoE in every layer."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: ModelConfig) -> None:
        check_supported(config)
        super().__init__(config, "model", GptOssModel(config))
