"""The persistent batch: one row per running request, updated in place every step.

Rows [0, num_reqs) are dense. A request keeps its row while it runs; when requests leave,
the last rows move into the holes (`condense`), so per-step work is proportional to what
changed, not to the batch size. Each row holds the request's token ids, its block-table
rows (one per KV-cache group) and its sampling state (`SamplingState`, same row index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenos.sample.state import SamplingState
from tokenos.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps (including while unscheduled)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class BlockTable:
    """One KV-cache group's block table: `[max_num_reqs, max_blocks]` int32 plus row lengths."""

    def __init__(self, max_num_reqs: int, max_blocks: int) -> None:
        self.table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        end = start + len(block_ids)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_group: list[int],
        vocab_size: int,
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
        self.sampling = SamplingState(max_num_reqs, vocab_size)
        self.prompt_logprobs_rows: set[int] = set()

    # ------------------------------------------------------------ membership

    def add_request(self, state: CachedRequestState) -> int:
        row = self.num_reqs
        self.num_reqs += 1
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        n_prompt = len(state.prompt_token_ids)
        n = state.num_tokens
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens
        for table, ids in zip(self.block_tables, state.block_ids, strict=True):
            table.set_row(row, ids)
        self.sampling.add_request(
            row, state.sampling_params, state.prompt_token_ids, state.output_token_ids, state.eos_token_id
        )
        if state.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs_rows.add(row)
        return row

    def remove_requests(self, req_ids: list[str]) -> None:
        """Drop the rows of `req_ids` and move the last rows into the holes."""
        holes = []
        for req_id in req_ids:
            row = self.req_id_to_index.pop(req_id, None)
            if row is None:
                continue
            self.req_ids[row] = None
            self.sampling.remove_request(row)
            self.prompt_logprobs_rows.discard(row)
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
        if src in self.prompt_logprobs_rows:
            self.prompt_logprobs_rows.discard(src)
            self.prompt_logprobs_rows.add(dst)

    # ------------------------------------------------------------ per-step updates

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.sampling.append_output(row, token_id)
