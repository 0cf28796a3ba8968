"""Route a checkpoint's (HF name, tensor) stream into a model, parameter by parameter.

Each parameter carries a ``weight_loader(param, tensor[, shard_id])``; fused modules
(qkv_proj, gate_up_proj) are reached through the model's ``packed_modules_mapping``
(``"q_proj": ("qkv_proj", "q")``). We raise if a parameter (or one shard of a fused one,
listed in its ``shard_ids``) is never loaded, so a naming mismatch never leaves
uninitialised weights behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenos.models.config import ModelConfig

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def iter_checkpoint_weights(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under Hugging Face names, whatever the file format."""
    if config.gguf_file:
        from tokenos.model_loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(config.model_path, config.num_attention_heads, config.num_key_value_heads)
    from tokenos.model_loader.safetensors_loader import iter_safetensors_weights

    return iter_safetensors_weights(config.model_path)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"Checkpoint tensor of shape {tuple(loaded.shape)} for parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def load_weights(model: nn.Module, config: ModelConfig, weights: Iterable | None = None) -> None:
    """Load ``weights`` (default: the checkpoint of ``config``) into ``model``."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    # Checkpoint parts the model does not run (e.g. multi-token-prediction heads): skipped by name.
    ignored_prefixes = tuple(getattr(model, "ignored_weight_prefixes", ()))
    loaded: dict[str, set] = {name: set() for name in params}
    with torch.no_grad():
        for name, tensor in weights if weights is not None else iter_checkpoint_weights(config):
            if (
                name.endswith(_IGNORED_SUFFIXES)
                or (config.tie_word_embeddings and name.startswith("lm_head."))
                or (ignored_prefixes and name.startswith(ignored_prefixes))
            ):
                continue
            target, shard_id = _resolve(name, packed)
            if target not in params:
                raise ValueError(
                    f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}"
                )
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"Checkpoint tensor {name!r}: {e}") from e
            loaded[target].add(shard_id)
    missing = sorted(n for n, p in params.items() if loaded[n] != set(getattr(p, "shard_ids", (None,))))
    if missing:
        raise ValueError(f"Checkpoint {config.model_path} lacks weights for: {', '.join(missing[:8])}")


def _resolve(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    for part, (fused, shard_id) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None
