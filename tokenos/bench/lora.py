"""Random PEFT adapters for the LoRA benchmark: rank-r LoRA on every attention and MLP projection of a
dense model, written in PEFT's folder format from the model's config (so the embedded GGUF model, which
has no transformers twin here, can be benchmarked with adapters)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tokenos.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from tokenos.models.config import ModelConfig


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted projection of one decoder layer, by its Hugging Face name."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def write_random_adapter(config: ModelConfig, folder: str, rank: int, seed: int) -> str:
    """A rank-`rank` adapter with A, B ~ N(0, 0.02) in `folder`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in projection_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE))
    targets = sorted({m.split(".")[-1] for m in projection_shapes(config)})
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}, f)
    return folder
