"""Request defaults from the model's `generation_config.json`, as vLLM takes them.

Model creators ship recommended sampling settings there (Qwen3: temperature 0.6, top_p 0.95, top_k 20).
With ``generation_config="auto"`` (vLLM's default) they become the defaults of every request that leaves
those fields unset, on the server and in `LLM.generate` without sampling params; ``"vllm"`` ignores the
file; a folder path reads the file from there. ``override_generation_config`` goes over either.
Only the sampling fields vLLM takes are read; ``max_new_tokens`` becomes ``max_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _read(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def generation_defaults(
    model_dir: str | None, generation_config: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> default, from the generation config (see the module docstring)."""
    if generation_config == "vllm":
        raw: dict[str, Any] = {}
    elif generation_config == "auto":
        raw = _read(model_dir) if model_dir and os.path.isdir(model_dir) else {}
    elif os.path.isdir(generation_config):
        raw = _read(generation_config)
    else:
        raise ValueError(
            f"generation_config {generation_config!r} is not 'auto', 'vllm' or a folder holding "
            "generation_config.json."
        )
    raw = {**raw, **(override or {})}
    unknown = set(override or {}) - set(SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"override_generation_config takes {sorted(SAMPLING_KEYS)}; not {sorted(unknown)}.")
    defaults = {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
    if defaults:
        logger.info("request defaults from the generation config: %s", defaults)
    return defaults


def engine_generation_defaults(engine: Any) -> dict[str, Any]:
    """The defaults of an engine (AsyncLLM or LLM): its args and its model folder."""
    args = getattr(engine, "engine_args", None)
    config = getattr(engine, "model_config", None)
    if args is None or config is None:
        return {}
    return generation_defaults(
        getattr(config, "model_dir", None), args.generation_config, args.override_generation_config
    )
