"""One step's flat token layout, computed with numpy from the persistent batch (no per-token Python).

The scheduled requests sit in batch rows ``[0, n)``; row ``r`` has ``num_computed[r]`` tokens in the
cache and runs ``num_scheduled[r]`` new ones, so it owns flat tokens ``[query_start[r], query_end[r])``
at positions ``num_computed[r] + 0 .. num_scheduled[r] - 1``. Attention groups address each token's
K/V by slot ``block_table[r][p // B] * B + p % B`` (`slot_mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepInputs:
    num_computed: np.ndarray  # int64 [n]: tokens in the cache before the step
    num_scheduled: np.ndarray  # int64 [n]: tokens computed this step
    query_start: np.ndarray  # int64 [n]: each row's first flat token
    query_end: np.ndarray  # int64 [n]: one past each row's last flat token
    rows: np.ndarray  # int64 [T]: the batch row of each flat token
    positions: np.ndarray  # int64 [T]
    input_ids: np.ndarray  # int64 [T]

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def seq_lens(self) -> np.ndarray:
        """Tokens in the cache after the step, per row."""
        return self.num_computed + self.num_scheduled

    @property
    def last_token_indices(self) -> np.ndarray:
        """The flat index of each row's last token (the one it samples from)."""
        return self.query_end - 1


def prepare_step_inputs(
    token_ids: np.ndarray, num_computed: np.ndarray, num_scheduled: np.ndarray
) -> StepInputs:
    """The flat layout of rows ``[0, n)`` of ``token_ids`` ``[max_reqs, max_len]``."""
    num_computed = np.asarray(num_computed, dtype=np.int64)
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    query_end = np.cumsum(num_scheduled)
    query_start = query_end - num_scheduled
    total = int(query_end[-1]) if len(query_end) else 0
    rows = np.repeat(np.arange(len(num_scheduled)), num_scheduled)
    positions = (
        np.repeat(num_computed, num_scheduled) + np.arange(total) - np.repeat(query_start, num_scheduled)
    )
    return StepInputs(
        num_computed, num_scheduled, query_start, query_end, rows, positions, token_ids[rows, positions]
    )


def slot_mapping(
    block_table: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """int64 [T]: the cache slot of each flat token, ``block_table[row][p // B] * B + p % B``."""
    slots = block_table[rows, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return slots
