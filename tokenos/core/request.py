"""One request as the engine core sees it: token ids, progress counters and a status.

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`, and `num_tokens == len(all_token_ids)`.
- `0 <= num_computed_tokens <= num_tokens`: tokens whose KV / state is in the cache (prefix hit
  plus everything computed in scheduled steps; the scheduler advances it when it schedules).
- `block_hashes[i]` is the chained hash of the prefix `all_token_ids[: (i + 1) * hash_block_size]`,
  extended incrementally as tokens are appended (only once a block's tokens are all known).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams, FinishReason

if TYPE_CHECKING:
    from tokenos.core.hashing import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is a finished state (`is_finished` relies on the order).
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class GrammarState(Protocol):
    """What the scheduler needs of a request's grammar matcher (tokenos.structured.backend.Matcher)."""

    def accept(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def validate(self, token_ids: list[int]) -> int:
        """How many leading speculative drafts the grammar accepts, without advancing (drafts are cut
        there)."""
        ...


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "cache_salt",
        "adapter_id",
        "lora_name",
        "output_token_ids",
        "all_token_ids",
        "max_total_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "status",
        "block_hashes",
        "num_preemptions",
        "stop_reason",
        "max_tokens",
        "stop_token_ids",
        "fork_of",
        "grammar",
        "spec_token_ids",
        "_block_hasher",
        "_next_hash_at",
        "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: EngineSamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        adapter_id: int | str | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        fork_of: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.lora_name = lora_name  # the adapter's name as requested (its metrics label)
        self.output_token_ids: list[int] = []
        # Prompt then outputs. A live list: read it, never mutate it from outside.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prefix-hit tokens at first admission (reported to the user); -1 until admitted.
        self.num_cached_tokens = -1
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # None: no cap besides max_model_len.
        self.max_tokens = sampling_params.max_tokens
        # Ids that end the request besides its EOS: the user's, and (unless ignore_eos) the model's
        # other EOS ids; either is reported as the stop_reason.
        stop = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop.update(extra_eos_token_ids)
        self.stop_token_ids = frozenset(stop)
        # min(prompt + max_tokens, max_model_len): set by the scheduler when the request is added.
        self.max_total_tokens = 1 << 62
        # Sibling of an n > 1 request: the id of the sample that computes the shared prompt.
        self.fork_of = fork_of
        # Structured output: the matcher of its grammar (tokenos.structured), attached when compiled.
        self.grammar: GrammarState | None = None
        # Speculative decoding: the proposer's draft tokens for the next step (never in all_token_ids:
        # only tokens the worker verified are ever appended, hashed or cached).
        self.spec_token_ids: list[int] = []
        self._block_hasher = None
        self._next_hash_at = 1 << 62
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        adapter_id: int | str | None = None,
    ) -> Request:
        """``adapter_id``: the key of the LoRA adapter ``req.lora_name`` resolved to (its name and content
        hash: it is in every block hash, so two adapters never share cached blocks)."""
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            adapter_id=adapter_id,
            block_hasher=block_hasher,
            fork_of=req.fork_of,
            extra_eos_token_ids=req.extra_eos_token_ids,
            lora_name=req.lora_name if adapter_id is not None else None,
        )

    # ------------------------------------------------------------------ tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        # Hash only when a whole new hash block is known: one int compare per decode token.
        if len(self.all_token_ids) >= self._next_hash_at:
            self._update_block_hashes()

    def set_block_hasher(self, block_hasher: Callable[[Request], list[BlockHash]]) -> None:
        """Attach the engine's hasher (granularity and function) and hash the known tokens."""
        self._block_hasher = block_hasher
        self.block_hashes = []
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        hasher = self._block_hasher
        if hasher is None:
            return
        self.block_hashes.extend(hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * hasher.hash_block_size  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ status

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def __lt__(self, other: Request) -> bool:
        # Priority-queue order: lower priority value, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
