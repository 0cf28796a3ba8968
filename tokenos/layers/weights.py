"""The one weight-loading idiom: every parameter knows how to take its checkpoint tensor.

A parameter may carry ``weight_loader(param, tensor[, shard_id])``: fused projections take one shard
(q / k / v, gate / up) into their rows, Qwen3-Next's norms store ``1 + w``, Falcon-H1 folds a muP
multiplier in. A parameter without one takes ``default_weight_loader``. Loading a whole model or one
layer is then a name lookup (`load_named_weights`), with the model's ``packed_modules_mapping`` routing
checkpoint q/k/v and gate/up names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenos.layers.quantization import QuantizedTensor

WeightLoader = Callable[..., None]
# Checkpoint module name -> (our fused module name, shard id), e.g. "q_proj": ("qkv_proj", "q").
PackedMapping = dict[str, tuple[str, str | int]]


def make_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialized inference parameter (no grad), filled from the checkpoint at load."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``; squeezed singleton dims are tolerated (a ``conv1d.weight``
    saved as ``[C, K]`` for a ``[C, 1, K]`` parameter)."""
    if loaded.numel() != param.numel() or loaded.squeeze().shape != param.squeeze().shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded.reshape(param.shape))


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def copy_rows(param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy ``loaded`` into rows ``[offset, offset + size)`` of a fused parameter."""
    target = param.data.narrow(0, offset, size)
    if target.shape != loaded.shape:
        raise ValueError(
            f"checkpoint shard of shape {tuple(loaded.shape)} for rows of shape {tuple(target.shape)}"
        )
    target.copy_(loaded)


def scale_on_load(
    param: nn.Parameter, factor: float | torch.Tensor, shard_id: str | int | None = None
) -> None:
    """Make ``param`` load ``factor * tensor`` (only shard ``shard_id`` of a fused parameter, if given): a
    multiplier on a linear's output folded into its weight and bias. ``factor`` broadcasts over rows."""
    inner = weight_loader_of(param)

    def loader(target: nn.Parameter, loaded: torch.Tensor, *shard: str | int) -> None:
        if shard_id is None or shard == (shard_id,):
            # A quantized checkpoint tensor (GPTQ / AWQ / GGUF) scales through its scales and zeros.
            loaded = loaded.scaled(factor) if isinstance(loaded, QuantizedTensor) else loaded.float() * factor
        inner(target, loaded, *shard)

    param.weight_loader = loader


class WeightHolder(nn.Module):
    """A named ``weight`` (+ optional ``bias``): keeps parameter names equal to the checkpoint's."""

    def __init__(self, weight_shape: tuple[int, ...], bias_size: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = make_param(*weight_shape, dtype=dtype)
        self.bias = None if bias_size is None else make_param(bias_size, dtype=dtype)


def resolve_packed(name: str, packed: PackedMapping) -> tuple[str, str | int | None]:
    """(parameter name, shard id) of checkpoint tensor ``name`` (shard None: not a fused parameter)."""
    for part, (fused, shard_id) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: PackedMapping | None = None,
    skip: Callable[[str], bool] | None = None,
) -> dict[str, set[str | int | None]]:
    """Load ``(name, tensor)`` pairs named relative to ``module``; returns parameter name -> the shard ids
    loaded into it (``{None}`` for a plain parameter). ValueError for a name no parameter answers to."""
    params = dict(module.named_parameters())
    loaded: dict[str, set[str | int | None]] = {}
    with torch.no_grad():
        for name, tensor in weights:
            if skip is not None and skip(name):
                continue
            target, shard_id = resolve_packed(name, packed or {})
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no matching parameter in {type(module).__name__}"
                )
            loader = weight_loader_of(param)
            try:
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from e
            loaded.setdefault(target, set()).add(shard_id)
    return loaded


def missing_weights(module: nn.Module, loaded: dict[str, set[str | int | None]]) -> list[str]:
    """Parameters (or shards of fused ones, listed in their ``shard_ids``) that were never loaded."""
    return sorted(
        name
        for name, p in module.named_parameters()
        if loaded.get(name, set()) != set(getattr(p, "shard_ids", (None,)))
    )
