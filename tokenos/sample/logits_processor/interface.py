"""Custom logits processors, in vLLM V1's shape: a class given at engine construction, one instance per
engine, that sees the whole batch.

A processor is told how the batch changed since the last step (`BatchUpdate`: rows added, removed,
moved) in `update_state`, then edits the step's logits in `apply`. It keeps its per-row state itself,
keyed by row index, and enables itself per request from the request's parameters (usually
``params.extra_args``). This is vLLM's ``vllm.v1.sample.logits_processor.LogitsProcessor``; a vLLM
processor runs unchanged against these names, with two tokenos differences:

- ``params`` in `BatchUpdate.added` (and in `LogitsProcessor.validate_params`) is the engine core's
  `tokenos.core.messages.EngineSamplingParams`: the token-level fields of `SamplingParams` under the same
  names (temperature, top_p, ..., logit_bias, allowed_token_ids, extra_args), no stop strings;
- ``vllm_config`` is an `EngineConfig`: ``model_config``, ``scheduler_config``, ``cache_config``
  (``vllm_config.scheduler_config.max_num_seqs`` and ``vllm_config.model_config.vocab_size`` work).

The batch a processor sees is the step's sampled batch: rows ``[0, batch_size)``, row i being row i of
the logits. A request that is not scheduled in a step leaves it (removed) and comes back later (added,
with its output so far), as in vLLM.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tokenos.core.messages import EngineSamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # a -> b: b takes a's request, a is left empty
    SWAP = enum.auto()  # a <-> b


# A row whose request left the batch.
RemovedRequest = int
# (row, params, prompt token ids, output token ids). The output list is the request's live list: the
# worker appends every sampled token to it, so a processor holding it always sees the output so far.
AddedRequest = tuple[int, "EngineSamplingParams", "list[int] | None", "list[int]"]
# (row a, row b, direction)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step. Apply in this order: removed, then added (an added
    row may replace a row's old request), then moved, one after the other."""

    batch_size: int  # rows in this step's batch
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True)
class EngineConfig:
    """What a processor's constructor receives as ``vllm_config``: the engine's resolved configs."""

    model_config: Any  # tokenos.models.config.ModelConfig (vocab_size, max_model_len, dtype, ...)
    scheduler_config: Any  # tokenos.config.SchedulerConfig (max_num_seqs, max_num_batched_tokens, ...)
    cache_config: Any  # tokenos.config.CacheConfig


class LogitsProcessor(ABC):
    """The interface of a custom logits processor (vLLM V1's)."""

    @classmethod
    def validate_params(cls, sampling_params: EngineSamplingParams) -> None:
        """Raise ValueError for parameters this processor cannot run with; called for every request
        before it is queued, so a bad request is refused (HTTP 400) instead of failing a step."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit the step's float32 logits ``[batch_size, vocab]`` (in place or not) and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token is the largest (so greedy rows need not see
        it): it is then applied after temperature, to random rows only; otherwise before the penalties,
        to every row."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once per step before `apply`; ``batch_update`` is None when the batch did not change
        (new output tokens are in the lists the processor was given)."""
        raise NotImplementedError
