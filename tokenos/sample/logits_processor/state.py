"""The engine's custom logits processors as one object, and the step's `BatchUpdate` they are told.

The worker's persistent batch changes by many small moves (rows removed and condensed, requests
appended, rows swapped to bring the scheduled ones to the front, unscheduled ones left beyond them).
Processors are told none of those: once per step `batch_update` compares which request held each row of
the batch the processors saw last step with the rows of this step, and says the difference in vLLM's
order (removed, then added, then moved). Requests are compared by a key the batch gives each request
when it is added (a request resumed after a preemption is a new key: it is added again, with its
output so far). A processor's state therefore follows its request wherever the batch moves it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tokenos.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    import torch

    from tokenos.core.messages import EngineSamplingParams

T = TypeVar("T")


class LogitsProcessors:
    """The engine's processors, split as the sampler applies them: the ones that can change the argmax
    (every row, before the penalties) and the argmax-invariant ones (random rows, after temperature)."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.all: list[LogitsProcessor] = list(processors)
        self.non_argmax_invariant = [p for p in self.all if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.all if p.is_argmax_invariant()]

    def __bool__(self) -> bool:
        return bool(self.all)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for processor in self.all:
            processor.update_state(batch_update)

    @staticmethod
    def apply_each(processors: Sequence[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        for processor in processors:
            logits = processor.apply(logits)
        return logits

    def for_row(self, row: int, batch_size: int) -> LogitsProcessors:
        """The processors as row ``row`` alone sees them, to sample that row by itself when a batched
        step failed: each still gets a whole batch (the row's logits in its row, zeros elsewhere), since
        its state is per batch row."""
        view = LogitsProcessors()
        view.non_argmax_invariant = [_OneRow(p, row, batch_size) for p in self.non_argmax_invariant]
        view.argmax_invariant = [_OneRow(p, row, batch_size) for p in self.argmax_invariant]
        view.all = view.non_argmax_invariant + view.argmax_invariant
        return view


class _OneRow:
    """One processor applied to a one-row logits tensor that stands for row ``row`` of the batch."""

    def __init__(self, processor: LogitsProcessor, row: int, batch_size: int) -> None:
        self.processor, self.row, self.batch_size = processor, row, batch_size

    def is_argmax_invariant(self) -> bool:
        return self.processor.is_argmax_invariant()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        import torch

        full = torch.zeros(self.batch_size, logits.shape[1], dtype=logits.dtype, device=logits.device)
        full[self.row] = logits[0]
        return self.processor.apply(full)[self.row : self.row + 1]


def batch_update(
    before: Sequence[Hashable], now: Sequence[Hashable], describe: Callable[[int, int], AddedRequest]
) -> BatchUpdate | None:
    """The update that turns a batch whose row i held request ``before[i]`` into one whose row i holds
    ``now[i]`` (None: nothing changed). ``describe(row, index)`` is the `AddedRequest` of the request now
    in ``row``, placed at ``index``.

    Added requests go straight to their row when it is free after the removals; otherwise (a request
    that is still to move away holds it) to the lowest free row, and a move takes them on. The moves
    then put each request in its row, left to right: a move into an empty row is one-way, into a taken
    row a swap, so each move settles one row and no settled row is touched again. Every row ends below
    ``len(now)``."""
    if list(before) == list(now):
        return None
    staying = set(now)
    removed = [row for row, key in enumerate(before) if key not in staying]
    held = {row: key for row, key in enumerate(before) if key in staying}  # row -> request
    at = {key: row for row, key in held.items()}  # request -> row
    added: list[AddedRequest] = []
    for row, key in enumerate(now):
        if key in at:
            continue
        index = row if row not in held else next(i for i in itertools.count() if i not in held)
        held[index], at[key] = key, index
        added.append(describe(row, index))
    # An added request replaces a removed one in its row: that row is not also reported removed (as in
    # vLLM, whose processors may handle the two lists in either order).
    taken = {entry[0] for entry in added}
    removed = [row for row in removed if row not in taken]
    moved: list[tuple[int, int, MoveDirectionality]] = []
    for row, key in enumerate(now):
        src = at[key]
        if src == row:
            continue
        other = held.get(row)
        if other is None:
            del held[src]
            moved.append((src, row, MoveDirectionality.UNIDIRECTIONAL))
        else:
            held[src], at[other] = other, src
            moved.append((src, row, MoveDirectionality.SWAP))
        held[row], at[key] = key, row
    return BatchUpdate(batch_size=len(now), removed=removed, added=added, moved=moved)


def process_dict_updates(
    entries: dict[int, T],
    update: BatchUpdate | None,
    new_state: Callable[[EngineSamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Apply ``update`` to a processor's per-row dict (row -> state, rows it does not act on absent):
    ``new_state(params, prompt ids, output ids)`` is an added request's state, None when the processor
    leaves it alone. True when the dict changed. (vLLM's helper of the same name.)"""
    if update is None:
        return False
    changed = False
    for row in update.removed:
        changed |= entries.pop(row, None) is not None
    for row, params, prompt_ids, output_ids in update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[row] = state
            changed = True
        else:
            changed |= entries.pop(row, None) is not None
    for a, b, direction in update.moved:
        a_state, b_state = entries.pop(a, None), entries.pop(b, None)
        if a_state is not None:
            entries[b] = a_state
        if b_state is not None and direction == MoveDirectionality.SWAP:
            entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed
