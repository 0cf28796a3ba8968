"""The step's flat token layout (tokenos/worker/step_inputs.py) against a per-token reference: rows,
positions, input ids and query starts/ends for batches mixing prefill chunks and decodes, and the slot
mapping of attention groups (also against the attention layer's own metadata builder)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenos.layers.attention_metadata import build_attention_metadata
from tokenos.worker.step_inputs import prepare_step_inputs, slot_mapping

MAX_REQS, MAX_LEN = 8, 64


def reference_layout(token_ids, num_computed, num_scheduled):
    """(rows, positions, input ids, query starts, query ends) token by token."""
    rows, positions, ids, starts, ends = [], [], [], [], []
    for r, (n, k) in enumerate(zip(num_computed, num_scheduled, strict=True)):
        starts.append(len(rows))
        for p in range(n, n + k):
            rows.append(r)
            positions.append(p)
            ids.append(int(token_ids[r, p]))
        ends.append(len(rows))
    return rows, positions, ids, starts, ends


def token_table(seed: int = 0) -> np.ndarray:
    """A persistent-batch token table (more rows than scheduled), every entry distinct."""
    return np.random.default_rng(seed).permutation(MAX_REQS * MAX_LEN).reshape(MAX_REQS, MAX_LEN) + 1000


def test_mixed_prefill_chunks_and_decodes() -> None:
    tokens = token_table()
    # row 0: a fresh prompt of 5; row 1: a decode at position 9; row 2: a chunk resuming at 16; row 3: a
    # decode at position 0 (a one-token prompt)
    inputs = prepare_step_inputs(tokens, [0, 9, 16, 0], [5, 1, 7, 1])
    assert inputs.num_reqs == 4 and inputs.num_tokens == 14
    assert inputs.query_start.tolist() == [0, 5, 6, 13] and inputs.query_end.tolist() == [5, 6, 13, 14]
    assert inputs.rows.tolist() == [0] * 5 + [1] + [2] * 7 + [3]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 9, *range(16, 23), 0]
    want_ids = [*tokens[0, :5], tokens[1, 9], *tokens[2, 16:23], tokens[3, 0]]
    assert inputs.input_ids.tolist() == [int(t) for t in want_ids]
    assert inputs.seq_lens.tolist() == [5, 10, 23, 1]
    assert inputs.last_token_indices.tolist() == [4, 5, 12, 13]
    for arr in (inputs.query_start, inputs.query_end, inputs.rows, inputs.positions, inputs.input_ids):
        assert arr.dtype == np.int64


def test_empty_step_and_a_row_with_nothing_scheduled() -> None:
    tokens = token_table()
    empty = prepare_step_inputs(tokens, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32))
    assert empty.num_reqs == 0 and empty.num_tokens == 0 and empty.input_ids.tolist() == []
    inputs = prepare_step_inputs(tokens, [3, 7, 2], [2, 0, 1])
    assert inputs.rows.tolist() == [0, 0, 2] and inputs.positions.tolist() == [3, 4, 2]
    assert inputs.query_start.tolist() == [0, 2, 2] and inputs.query_end.tolist() == [2, 2, 3]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, MAX_LEN - 1), st.integers(1, MAX_LEN)), min_size=1, max_size=MAX_REQS
    ),
    num_decodes=st.integers(0, MAX_REQS),
    seed=st.integers(0, 3),
)
def test_layout_matches_the_per_token_reference(rows, num_decodes, seed) -> None:
    # Each row: n computed tokens then k scheduled ones (k = 1 for the first `num_decodes`: decodes),
    # inside the row's length.
    num_computed, num_scheduled = [], []
    for i, (n, k) in enumerate(rows):
        k = 1 if i < num_decodes else k
        n = min(n, MAX_LEN - k)
        num_computed.append(n)
        num_scheduled.append(k)
    tokens = token_table(seed)
    inputs = prepare_step_inputs(tokens, np.array(num_computed, np.int32), np.array(num_scheduled, np.int32))
    want_rows, want_pos, want_ids, starts, ends = reference_layout(tokens, num_computed, num_scheduled)
    assert inputs.rows.tolist() == want_rows
    assert inputs.positions.tolist() == want_pos
    assert inputs.input_ids.tolist() == want_ids
    assert inputs.query_start.tolist() == starts and inputs.query_end.tolist() == ends
    assert inputs.num_computed.tolist() == num_computed and inputs.num_scheduled.tolist() == num_scheduled
    assert inputs.seq_lens.tolist() == [n + k for n, k in zip(num_computed, num_scheduled, strict=True)]
    assert inputs.last_token_indices.tolist() == [e - 1 for e in ends]
    assert inputs.num_tokens == sum(num_scheduled) and inputs.num_reqs == len(rows)


def test_slot_mapping_example_agrees_with_the_attention_metadata() -> None:
    # The example of tests/layers/test_attention.py, through the worker's numpy path.
    lists, computed, scheduled, block_size = [[5, 2], [7], [3, 9, 4]], [6, 0, 9], [1, 3, 2], 4
    table = np.zeros((3, 3), dtype=np.int32)
    for r, ids in enumerate(lists):
        table[r, : len(ids)] = ids
    inputs = prepare_step_inputs(np.zeros((3, 16), dtype=np.int64), computed, scheduled)
    slots = slot_mapping(table, inputs.rows, inputs.positions, block_size)
    assert slots.tolist() == [10, 28, 29, 30, 17, 18] and slots.dtype == np.int64
    meta = build_attention_metadata(lists, computed, scheduled, block_size)
    assert slots.tolist() == meta.slot_mapping.tolist()


def test_slot_mapping_does_not_overflow_int32_block_ids() -> None:
    table = np.array([[2**28, 3]], dtype=np.int32)
    slots = slot_mapping(table, np.array([0, 0]), np.array([5, 17]), 16)
    assert slots.tolist() == [2**28 * 16 + 5, 3 * 16 + 1]


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_slot_mapping_matches_the_definition(block_size, data) -> None:
    num_reqs = data.draw(st.integers(1, 5))
    max_blocks = MAX_LEN // block_size
    table = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(0, 10_000), min_size=max_blocks, max_size=max_blocks),
                min_size=num_reqs,
                max_size=num_reqs,
            )
        ),
        dtype=np.int32,
    )
    n = data.draw(st.lists(st.integers(0, MAX_LEN - 1), min_size=num_reqs, max_size=num_reqs))
    k = [data.draw(st.integers(1, MAX_LEN - ni)) for ni in n]
    inputs = prepare_step_inputs(np.zeros((num_reqs, MAX_LEN), dtype=np.int64), n, k)
    slots = slot_mapping(table, inputs.rows, inputs.positions, block_size)
    want = [
        int(table[r, p // block_size]) * block_size + p % block_size
        for r, p in zip(inputs.rows.tolist(), inputs.positions.tolist(), strict=True)
    ]
    assert slots.tolist() == want


@pytest.mark.parametrize("block_size", [4, 16])
def test_slot_mapping_agrees_with_the_attention_metadata_on_random_batches(block_size) -> None:
    rng = np.random.default_rng(block_size)
    for _ in range(20):
        num_reqs = int(rng.integers(1, 6))
        computed = rng.integers(0, 40, num_reqs).tolist()
        scheduled = [1 if rng.random() < 0.5 else int(rng.integers(1, 20)) for _ in range(num_reqs)]
        lists = [
            rng.permutation(np.arange(1, 200))[: -(-(n + k) // block_size)].tolist()
            for n, k in zip(computed, scheduled, strict=True)
        ]
        width = max(len(ids) for ids in lists)
        table = np.zeros((num_reqs, width), dtype=np.int32)
        for r, ids in enumerate(lists):
            table[r, : len(ids)] = ids
        inputs = prepare_step_inputs(np.zeros((num_reqs, 64), dtype=np.int64), computed, scheduled)
        slots = slot_mapping(table, inputs.rows, inputs.positions, block_size)
        meta = build_attention_metadata(lists, computed, scheduled, block_size)
        assert slots.tolist() == meta.slot_mapping.tolist()
        assert inputs.seq_lens.tolist() == meta.seq_lens.tolist()
        assert inputs.query_start.tolist() == meta.query_start_loc[:-1].tolist()
