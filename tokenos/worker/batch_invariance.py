"""Whether batch invariance (``TOKENOS_BATCH_INVARIANT=1``, see docs/architecture.md) holds for a model.

It is built for Llama-style decoders (tokenos/models/llama.py: Llama, Mistral, Qwen2, Qwen3, ...) with
every linear on csrc/qlinear.c's kernel: the kernels it makes invariant are the quantized linears and
attention, and every other module of those models works a row at a time (norms, rotary, SiLU, the
embedding's rows). A module of any other kind (a mixture of experts, a recurrent mixer, a dense GEMM)
would change a token's logits with its batch, so the model is refused rather than run without it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenos.layers import cpu_kernels
from tokenos.layers.activation import SiluAndMul
from tokenos.layers.attention import Attention
from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.linear import Linear, MergedLinear, QKVLinear
from tokenos.layers.rotary import RotaryEmbedding
from tokenos.models import llama

# Exact types (not subclasses, which may compute otherwise).
ROW_WISE = (SiluAndMul, Attention, VocabEmbedding, RMSNorm, RotaryEmbedding, nn.ModuleList)
DECODER = (
    llama.DecoderAttention,
    llama.DecoderLayer,
    llama.DecoderMLP,
    llama.DecoderModel,
    llama.LlamaForCausalLM,
)
QUANTIZED = (Linear, MergedLinear, QKVLinear, LMHead)


def check_batch_invariant(model: nn.Module, dtype: torch.dtype) -> None:
    """Raise ValueError, saying what to do, where the mode is on and cannot hold for ``model``."""
    if not cpu_kernels.batch_invariant():
        return
    modules = list(model.modules())
    other = sorted({type(m).__name__ for m in modules if type(m) not in ROW_WISE + DECODER + QUANTIZED})
    if other:
        raise ValueError(
            "TOKENOS_BATCH_INVARIANT=1 is built for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3), but "
            f"this model has {', '.join(other)}, whose results would depend on the batch. Unset "
            "TOKENOS_BATCH_INVARIANT for this model."
        )
    dense = sorted({type(m).__name__ for m in modules if type(m) in QUANTIZED and m.quantized is None})
    # bf16 rows without the bf16 kernel (an AVX2 build) run the fp32 one, invariant as well.
    kernel = cpu_kernels.qgemm_kernel(dtype) or cpu_kernels.qgemm_kernel(torch.float32)
    if dense or kernel is None:
        what = f"dense weights in {', '.join(dense)}" if dense else "no quantized kernel for this CPU"
        raise ValueError(
            "TOKENOS_BATCH_INVARIANT=1 needs every linear on the quantized C kernel, but this model has "
            f"{what} (torch's GEMM picks its blocking by row count). Load a quantized checkpoint or pass "
            "quantization='int8' (or 'int4'), or unset TOKENOS_BATCH_INVARIANT."
        )
