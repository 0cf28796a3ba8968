"""Hugging Face safetensors folders: one ``model.safetensors`` or shards listed in an index file."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(folder: str) -> list[str]:
    """The shard files of a folder, in index order when an index exists."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {folder}")
    return files


def iter_safetensors_weights(folder: str, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard whose name starts with ``prefix``, without
    loading all at once (a tensor outside ``prefix`` is never read)."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def safetensors_names(folder: str) -> list[str]:
    """Every tensor name of a folder's shards (headers only)."""
    names: list[str] = []
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names
