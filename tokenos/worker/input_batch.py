"""The persistent batch: the worker's one copy of every running request's state, one row each.

A request gets a row when the scheduler first sends it (`add_request`) and keeps it until it finishes or
is preempted (`remove_requests`), scheduled in a step or not: its token ids, counters, block-table rows
(one per KV-cache group) and sampling state (`SamplingState`, same row index) live only here. Each step
`gather_scheduled` swaps rows so the scheduled requests occupy rows ``[0, n)``, which is what the step's
input layout and the sampler read; usually nothing moves. When requests leave, the last rows move into
the holes, so per-step work is proportional to what changed, not to the batch size.

The engine's custom logits processors (`tokenos.sample.logits_processor`) are told none of those
moves one by one: every request gets a key when it is added, the key moves with its row, and once per
step `update_logits_processors` compares the keys of the rows they saw last step with this step's and
tells them the difference as one `BatchUpdate`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from tokenos.core.messages import EngineSamplingParams
from tokenos.sample.logits_processor import AddedRequest, LogitsProcessors, batch_update
from tokenos.sample.state import SamplingState


class BlockTable:
    """One KV-cache group's block table: `[max_num_reqs, max_blocks]` int32 plus row lengths."""

    def __init__(self, max_num_reqs: int, max_blocks: int) -> None:
        self.table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: Sequence[int]) -> None:
        n = len(block_ids)
        self.table[row, :n] = block_ids
        self.table[row, n : max(n, self.num_blocks[row])] = 0  # no stale ids past the row's end
        self.num_blocks[row] = n

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        start = self.num_blocks[row]
        end = start + len(block_ids)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_columns(self, row: int, columns: Sequence[int]) -> None:
        """The request gave these columns up: they point at the null block again."""
        self.table[row, list(columns)] = 0

    def row(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.table[dst, n : max(n, self.num_blocks[dst])] = 0
        self.num_blocks[dst] = n

    def swap_rows(self, a: int, b: int) -> None:
        n = max(self.num_blocks[a], self.num_blocks[b])
        self.table[[a, b], :n] = self.table[[b, a], :n]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_group: list[int],
        vocab_size: int,
        logitsprocs: LogitsProcessors | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_tables = [BlockTable(max_num_reqs, n) for n in max_blocks_per_group]
        self.logitsprocs = logitsprocs if logitsprocs else None
        self.sampling = SamplingState(max_num_reqs, vocab_size, logitsprocs=self.logitsprocs)
        # row -> top-n of the prompt logprobs that request wants (rows without an entry want none).
        self.prompt_logprobs: dict[int, int] = {}
        # Per row: the request's key (unique per add) and parameters, for the logits processors.
        self.row_keys: list[int | None] = [None] * max_num_reqs
        self.row_params: list[EngineSamplingParams | None] = [None] * max_num_reqs
        self._next_key = 0
        self._seen_keys: list[int | None] = []  # the rows the processors saw last step

    # ------------------------------------------------------------ membership

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        num_computed_tokens: int,
        block_ids: Sequence[Sequence[int]],
        sampling_params: EngineSamplingParams,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> int:
        """Give a request the next free row; `output_token_ids` is what it generated before a preemption."""
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        if self.num_reqs == self.max_num_reqs:
            raise ValueError(f"the batch is full ({self.max_num_reqs} requests)")
        row = self.num_reqs
        self.num_reqs += 1
        self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        n_prompt = len(prompt_token_ids)
        n = n_prompt + len(output_token_ids)
        self.token_ids[row, :n_prompt] = prompt_token_ids
        self.token_ids[row, n_prompt:n] = output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = num_computed_tokens
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.set_row(row, ids)
        self.sampling.add_request(
            row, sampling_params, list(prompt_token_ids), list(output_token_ids), eos_token_id, stop_token_ids
        )
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs[row] = sampling_params.prompt_logprobs
        self.row_keys[row], self.row_params[row] = self._next_key, sampling_params
        self._next_key += 1
        return row

    def remove_requests(self, req_ids: Collection[str]) -> None:
        """Drop the rows of `req_ids` (unknown ids are ignored) and move the last rows into the holes."""
        holes = []
        for req_id in req_ids:
            row = self.req_id_to_index.pop(req_id, None)
            if row is None:
                continue
            self.req_ids[row] = None
            self.sampling.remove_request(row)
            self.prompt_logprobs.pop(row, None)
            self.row_keys[row] = self.row_params[row] = None
            holes.append(row)
        if holes:
            self._condense(sorted(holes))

    def _condense(self, holes: list[int]) -> None:
        last = self.num_reqs - 1
        new_count = self.num_reqs - len(holes)
        for hole in holes:
            if hole >= new_count:
                break
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self.num_reqs = new_count

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        for table in self.block_tables:
            table.move_row(src, dst)
        self.sampling.move_row(src, dst)
        if src in self.prompt_logprobs:
            self.prompt_logprobs[dst] = self.prompt_logprobs.pop(src)
        for per_row in (self.row_keys, self.row_params):
            per_row[dst], per_row[src] = per_row[src], None

    def swap_rows(self, a: int, b: int) -> None:
        ra, rb = self.req_ids[a], self.req_ids[b]
        assert ra is not None and rb is not None
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[rb], self.req_id_to_index[ra] = a, b
        n = max(self.num_tokens[a], self.num_tokens[b])
        self.token_ids[[a, b], :n] = self.token_ids[[b, a], :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[[a, b]] = arr[[b, a]]
        for table in self.block_tables:
            table.swap_rows(a, b)
        self.sampling.swap_rows(a, b)
        pa, pb = self.prompt_logprobs.pop(a, None), self.prompt_logprobs.pop(b, None)
        if pa is not None:
            self.prompt_logprobs[b] = pa
        if pb is not None:
            self.prompt_logprobs[a] = pb
        for per_row in (self.row_keys, self.row_params):
            per_row[a], per_row[b] = per_row[b], per_row[a]

    def gather_scheduled(self, scheduled: Collection[str]) -> int:
        """Swap rows so that rows ``[0, n)`` hold exactly the requests in `scheduled`; returns n."""
        n = len(scheduled)
        misplaced = [r for r in range(n) if self.req_ids[r] not in scheduled]
        if misplaced:
            outside = [r for r in range(n, self.num_reqs) if self.req_ids[r] in scheduled]
            if len(outside) != len(misplaced):
                unknown = sorted(set(scheduled) - set(self.req_id_to_index))
                raise ValueError(f"scheduled requests {unknown} are not in the batch")
            for a, b in zip(misplaced, outside, strict=True):
                self.swap_rows(a, b)
        return n

    def order_rows(self, order: list[int]) -> None:
        """Permute rows ``[0, len(order))`` so that row i then holds what row ``order[i]`` holds now."""
        position = list(range(len(order)))  # where each original row is now
        at = list(range(len(order)))  # which original row each position holds now
        for i, want in enumerate(order):
            j = position[want]
            if j != i:
                self.swap_rows(i, j)
                at[i], at[j] = at[j], at[i]
                position[at[i]], position[at[j]] = i, j

    # ------------------------------------------------------------ logits processors

    def update_logits_processors(self, n: int) -> None:
        """Tell the logits processors (if any) how rows ``[0, n)``, this step's batch, differ from the
        rows they saw last step; call after `gather_scheduled`, before sampling."""
        if self.logitsprocs is None:
            return
        now = self.row_keys[:n]
        self.logitsprocs.update_state(batch_update(self._seen_keys, now, self._added))
        self._seen_keys = now

    def _added(self, row: int, index: int) -> AddedRequest:
        params = self.row_params[row]
        assert params is not None
        # The live output list: sampled tokens are appended to it (`append_token`).
        return (index, params, self.sampling.prompt_token_ids[row], self.sampling.output_token_ids[row])

    # ------------------------------------------------------------ per-step updates

    def update_request(
        self,
        req_id: str,
        num_computed_tokens: int,
        removed_columns: Sequence[Sequence[int]] | None,
        new_block_ids: Sequence[Sequence[int]] | None,
    ) -> None:
        """Apply the scheduler's diff for a request the worker holds: its computed count, the columns it
        gave up (set to the null block first), then the blocks appended to each group."""
        row = self.req_id_to_index[req_id]
        self.num_computed_tokens[row] = num_computed_tokens
        if removed_columns is not None:
            for table, columns in zip(self.block_tables, removed_columns, strict=True):
                if columns:
                    table.clear_columns(row, columns)
        if new_block_ids is not None:
            for table, added in zip(self.block_tables, new_block_ids, strict=True):
                if added:
                    table.append(row, added)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.sampling.append_output(row, token_id)

    def block_ids(self, req_id: str, group: int) -> list[int]:
        """The request's block list of one group (what copies index into)."""
        return self.block_tables[group].row(self.req_id_to_index[req_id])
