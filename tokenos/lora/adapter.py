"""A PEFT LoRA adapter read from its folder and fitted onto our model's linears.

A PEFT folder holds ``adapter_config.json`` (r, lora_alpha, target_modules, use_rslora, ...) and
``adapter_model.safetensors`` with, per adapted module of the Hugging Face model,
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]; the module's
output gains ``scale * B (A x)`` with scale ``lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA).

Our models fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (`FUSED_QKV_GATE_UP`), so an
adapter's ``q_proj`` lands on the q rows of ``qkv_proj``. Per fused module the pieces are stacked once
at load: ``A`` as [sum r, in] (one shrink for all of them) and, per piece, its scaled ``B^T`` [r, size]
with the output columns it adds to (no zeros for the shards it leaves alone).

Everything an adapter could get wrong is refused here, naming the module and the shapes: a different
base model (shapes that do not fit), a rank above ``max_lora_rank``, targets we do not adapt (embeddings,
the LM head, MoE experts), and PEFT features that change the result but are not built (DoRA, bias
training, ``modules_to_save``, per-module rank or alpha patterns).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tokenos.layers.linear import Linear
from tokenos.models.base import FUSED_QKV_GATE_UP

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterInfo:
    """What the engine knows of a loaded adapter: the identity requests and block hashes carry is
    ``key`` (its name and the hash of its files), so new weights under an old name are a new adapter."""

    name: str
    path: str
    content_hash: str
    rank: int

    @property
    def key(self) -> str:
        return f"{self.name}@{self.content_hash[:16]}"

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "rank": self.rank, "key": self.key}


@dataclass
class Piece:
    """One adapted shard: ``y[:, offset : offset + size] += t[:, r0 : r0 + rows] @ bt``."""

    offset: int
    size: int
    r0: int
    rows: int
    bt: torch.Tensor  # [rows, size], scale folded in


@dataclass
class ModuleWeights:
    """One adapter on one linear: ``t = x @ a^T``, then each piece adds its columns."""

    a: torch.Tensor  # [sum r, in]
    pieces: list[Piece]
    desc: Any = None  # the C kernel's descriptor of the above (`tokenos.lora.layers`), once made

    @cached_property
    def macs_per_token(self) -> int:
        return self.a.numel() + sum(p.rows * p.size for p in self.pieces)


def content_hash(path: str) -> str:
    """sha256 over the adapter's config and weights files."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def read_config(path: str, name: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a folder.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE} (a PEFT adapter folder).")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(
            f"LoRA adapter {name!r}: {path!r} has no {WEIGHTS_FILE}; save the adapter with "
            "safe_serialization=True (PEFT's default)."
        )
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e}).") from None
    _check_config(config, name)
    return config


def _check_config(config: dict, name: str) -> None:
    def refuse(what: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {what} is not supported.")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config.get('bias')!r} (only 'none')")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']}")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise refuse("a per-module rank_pattern / alpha_pattern")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {r!r}.")


def scale_of(config: dict) -> float:
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def load_adapter(
    path: str, name: str, model: nn.Module, max_rank: int, dtype: torch.dtype
) -> tuple[AdapterInfo, dict[str, ModuleWeights]]:
    """Read, check and fit an adapter onto ``model``: its info and, per our module name, its weights."""
    config = read_config(path, name)
    rank = config["r"]
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}: start the engine "
            f"with max_lora_rank >= {rank}."
        )
    digest = content_hash(path)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    pieces = _pieces(tensors, name, model, rank)
    scale = scale_of(config)
    weights = {
        module: _stack(model.get_submodule(module), parts, scale, dtype) for module, parts in pieces.items()
    }
    return AdapterInfo(name, os.path.abspath(path), digest, rank), weights


# module -> [(shard id or None, A [r, in], B [out, r])]
Pieces = dict[str, list[tuple[str | int | None, torch.Tensor, torch.Tensor]]]


def _pieces(tensors: dict[str, torch.Tensor], name: str, model: nn.Module, rank: int) -> Pieces:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _split_key(key, name)
        pairs.setdefault(module, {})[kind] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r} holds no lora_A / lora_B weights.")
    modules = dict(model.named_modules())
    pieces: Pieces = {}
    for hf_module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"LoRA adapter {name!r}: {hf_module} has {sorted(pair)}, needs lora_A and lora_B."
            )
        target, shard = _our_module(hf_module, modules, name)
        a, b = pair["lora_A"], pair["lora_B"]
        _check_shapes(modules[target], shard, hf_module, a, b, rank, name)
        pieces.setdefault(target, []).append((shard, a, b))
    return pieces


def _split_key(key: str, name: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (module, "lora_A")."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        what = "embedding LoRA" if "lora_embedding" in key else f"tensor {key!r} (not a lora_A / lora_B)"
        raise ValueError(
            f"LoRA adapter {name!r}: {what} is not supported: tokenos adapts linears only, and does not "
            "load base-model weights saved with an adapter (modules_to_save, embedding layers)."
        )
    module = ".".join(parts[:-2])
    return (module[len(_PREFIX) :] if module.startswith(_PREFIX) else module), parts[-2]


def _our_module(hf_module: str, modules: dict[str, nn.Module], name: str) -> tuple[str, str | int | None]:
    """The linear of ours that computes ``hf_module`` and its shard there (None: all of it)."""
    if isinstance(modules.get(hf_module), Linear):
        return hf_module, None
    parent, _, leaf = hf_module.rpartition(".")
    if leaf in FUSED_QKV_GATE_UP:
        fused, shard = FUSED_QKV_GATE_UP[leaf]
        target = f"{parent}.{fused}" if parent else fused
        if isinstance(modules.get(target), Linear):
            return target, shard
    raise ValueError(
        f"LoRA adapter {name!r} adapts {hf_module}, which this model has no linear layer for (tokenos "
        "adapts the attention and MLP projections of dense models; not embeddings, the LM head or MoE "
        "experts). Was it trained on a different base model?"
    )


def _check_shapes(
    module: Linear,
    shard: str | int | None,
    hf_module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    rank: int,
    name: str,
) -> None:
    in_features = module.input_size
    out_features = module.output_size if shard is None else module.shard_offset(shard)[1]
    want_a, want_b = (rank, in_features), (out_features, rank)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise ValueError(
            f"LoRA adapter {name!r} does not fit this model: {hf_module} needs lora_A {list(want_a)} and "
            f"lora_B {list(want_b)} (rank {rank}), the adapter has {list(a.shape)} and {list(b.shape)}. "
            "Was it trained on a different base model?"
        )


def _stack(
    module: Linear,
    parts: list[tuple[str | int | None, torch.Tensor, torch.Tensor]],
    scale: float,
    dtype: torch.dtype,
) -> ModuleWeights:
    pieces, r0 = [], 0
    for shard, a, b in parts:
        offset, size = (0, module.output_size) if shard is None else module.shard_offset(shard)
        bt = (scale * b.float()).t().to(dtype).contiguous()
        pieces.append(Piece(offset, size, r0, a.shape[0], bt))
        r0 += a.shape[0]
    a = torch.cat([a for _, a, _ in parts]).to(dtype).contiguous()
    return ModuleWeights(a, sorted(pieces, key=lambda p: p.offset))
