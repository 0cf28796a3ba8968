"""Finding and building the engine's custom logits processors (``LLM(logits_processors=[...])``,
``EngineArgs.logits_processors``): classes, or ``"package.module:ClassName"`` strings imported here, as
vLLM's ``--logits-processors`` takes them. Every class must subclass `LogitsProcessor`; a bad entry is a
ValueError when the engine is built, never later."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from tokenos.core.validation import InvalidRequestError
from tokenos.sample.logits_processor.interface import EngineConfig, LogitsProcessor
from tokenos.sample.logits_processor.state import LogitsProcessors

LogitsProcessorSpec = str | type


def load_logits_processors(specs: Sequence[LogitsProcessorSpec] | None) -> list[type[LogitsProcessor]]:
    """The processor classes named by ``specs`` (classes, or ``module:Class`` strings)."""
    if isinstance(specs, str | type):
        specs = [specs]
    return [_load_one(spec) for spec in specs or ()]


def _load_one(spec: LogitsProcessorSpec) -> type[LogitsProcessor]:
    cls = _import_class(spec) if isinstance(spec, str) else spec
    if not isinstance(cls, type) or not issubclass(cls, LogitsProcessor):
        raise ValueError(
            f"logits_processors: {spec!r} is not a subclass of tokenos.sample.logits_processor."
            "LogitsProcessor (custom processors implement __init__(vllm_config, device, is_pin_memory), "
            "is_argmax_invariant(), update_state(batch_update) and apply(logits))."
        )
    return cls


def _import_class(spec: str) -> Any:
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"logits_processors: {spec!r} must be written 'package.module:ClassName'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"logits_processors: cannot import module {module_name!r} ({e}).") from e
    for attr in qualname.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"logits_processors: module {module_name!r} has no {qualname!r}.")
        obj = getattr(obj, attr)
    return obj


def build_logits_processors(
    classes: Sequence[type[LogitsProcessor]], config: EngineConfig, device: Any = "cpu"
) -> LogitsProcessors:
    """One instance of each class, built as vLLM builds them: ``cls(vllm_config, device, is_pin_memory)``
    (no pinned memory on a CPU)."""
    import torch

    return LogitsProcessors(cls(config, torch.device(device), False) for cls in classes)


def validate_logits_processor_params(classes: Sequence[type[LogitsProcessor]], params: Any) -> None:
    """InvalidRequestError when a processor's ``validate_params`` refuses the request's parameters."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except InvalidRequestError:
            raise
        except ValueError as e:
            message = f"Logits processor {cls.__name__} refused the request: {e}"
            raise InvalidRequestError(message, "extra_args") from e
