"""Custom logits processors, vLLM V1's interface: see `interface` for the contract, `state` for how the
batch's changes reach them, `load` for how the engine finds them."""

from tokenos.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    EngineConfig,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from tokenos.sample.logits_processor.load import (
    build_logits_processors,
    load_logits_processors,
    validate_logits_processor_params,
)
from tokenos.sample.logits_processor.state import LogitsProcessors, batch_update, process_dict_updates

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "EngineConfig",
    "LogitsProcessor",
    "LogitsProcessors",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "batch_update",
    "build_logits_processors",
    "load_logits_processors",
    "process_dict_updates",
    "validate_logits_processor_params",
]
