"""The persistent batch (tokenos/worker/input_batch.py): BlockTable rows, and InputBatch keeping every
request's state (tokens, counters, block tables, sampling state, prompt-logprob wish) with its request
through adds, removals (holes condensed), swaps, gathers and per-step updates.

Focused cases first, then a hypothesis state machine that runs random operations against a plain-dict
model of the batch and checks every row after every one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenos.core.messages import EngineSamplingParams
from tokenos.worker.input_batch import BlockTable, InputBatch

MAX_REQS, MAX_LEN, MAX_BLOCKS = 6, 24, [6, 3]  # two KV-cache groups
VOCAB = 100


def params(temperature: float = 0.5, prompt_logprobs: int | None = None, **kw) -> EngineSamplingParams:
    return EngineSamplingParams(temperature=temperature, prompt_logprobs=prompt_logprobs, **kw)


def make_batch(max_reqs: int = MAX_REQS) -> InputBatch:
    return InputBatch(max_reqs, MAX_LEN, MAX_BLOCKS, VOCAB)


def add(batch: InputBatch, rid: str, prompt, outputs=(), computed=0, blocks=([], []), **kw) -> int:
    return batch.add_request(rid, prompt, outputs, computed, blocks, params(**kw), eos_token_id=2)


# ---------------------------------------------------------------- BlockTable


def test_block_table_rows() -> None:
    t = BlockTable(4, 5)
    t.set_row(1, [7, 3])
    t.append(1, [9])
    t.append(1, [])
    assert t.row(1) == [7, 3, 9] and t.num_blocks.tolist() == [0, 3, 0, 0]
    t.clear_columns(1, [0, 2])  # the request gave these pages up: null block, length unchanged
    assert t.row(1) == [0, 3, 0]
    t.append(1, [4])
    assert t.row(1) == [0, 3, 0, 4]
    t.set_row(1, [5])  # a new request in the row: only its own blocks count
    assert t.row(1) == [5]
    assert t.row(0) == [] and t.table.dtype == np.int32


def test_block_table_move_and_swap_rows_of_different_lengths() -> None:
    t = BlockTable(3, 4)
    t.set_row(0, [1, 2, 3, 4])
    t.set_row(1, [5])
    t.swap_rows(0, 1)
    assert t.row(0) == [5] and t.row(1) == [1, 2, 3, 4]
    t.swap_rows(1, 0)
    assert t.row(0) == [1, 2, 3, 4] and t.row(1) == [5]
    t.move_row(0, 2)
    assert t.row(2) == [1, 2, 3, 4]
    t.set_row(0, [8, 9])
    t.move_row(0, 2)  # a shorter row moved over a longer one: only its own blocks
    assert t.row(2) == [8, 9]


# ---------------------------------------------------------------- InputBatch, focused


def test_add_request_fills_the_next_row() -> None:
    b = make_batch()
    assert add(b, "a", [5, 6, 7], blocks=([1], [2])) == 0
    # a request resumed after a preemption: its earlier outputs follow the prompt
    assert add(b, "b", [8, 9], outputs=[10, 11], computed=3, blocks=([3, 4], [5]), prompt_logprobs=2) == 1
    assert b.num_reqs == 2 and b.req_ids[:3] == ["a", "b", None] and b.req_id_to_index == {"a": 0, "b": 1}
    assert b.token_ids[1, :4].tolist() == [8, 9, 10, 11]
    assert (b.num_tokens[1], b.num_prompt_tokens[1], b.num_computed_tokens[1]) == (4, 2, 3)
    assert b.block_ids("b", 0) == [3, 4] and b.block_ids("b", 1) == [5] and b.block_ids("a", 1) == [2]
    assert b.sampling.prompt_token_ids[1] == [8, 9] and b.sampling.output_token_ids[1] == [10, 11]
    assert b.prompt_logprobs == {1: 2}
    with pytest.raises(ValueError, match="already in the batch"):
        add(b, "a", [1])


def test_a_full_batch_refuses_more() -> None:
    b = make_batch(max_reqs=2)
    add(b, "a", [3])
    add(b, "b", [4])
    with pytest.raises(ValueError, match="full"):
        add(b, "c", [5])
    b.remove_requests(["a"])
    assert add(b, "c", [5]) == 1


def test_remove_requests_condenses_from_the_end() -> None:
    b = make_batch()
    for i, rid in enumerate("abcdef"):
        add(b, rid, [10 + i] * (i + 1), blocks=([20 + i], [30 + i]), temperature=0.1 * (i + 1))
    b.remove_requests(["b", "nope", "e"])  # unknown ids are ignored
    # The last rows fill the holes: f -> row 1; e itself was a hole, so d stays.
    assert b.num_reqs == 4 and b.req_ids == ["a", "f", "c", "d", None, None]
    assert b.req_id_to_index == {"a": 0, "f": 1, "c": 2, "d": 3}
    assert b.token_ids[1, :6].tolist() == [15] * 6 and b.num_tokens[1] == 6
    assert b.block_ids("f", 0) == [25] and b.block_ids("f", 1) == [35]
    assert b.sampling.temperature[1].item() == pytest.approx(0.6)
    assert b.sampling.occupied == [True] * 4 + [False] * 2
    b.remove_requests(["a", "f", "c", "d"])
    assert b.num_reqs == 0 and b.req_id_to_index == {} and b.req_ids == [None] * 6


def test_remove_holes_at_the_front_take_the_last_live_rows() -> None:
    b = make_batch()
    for rid in "abcde":
        add(b, rid, [3])
    b.remove_requests(["a", "b", "e"])
    assert b.req_ids[:2] == ["d", "c"] and b.num_reqs == 2


def test_gather_scheduled_moves_only_misplaced_rows() -> None:
    b = make_batch()
    for i, rid in enumerate("abcde"):
        add(b, rid, [10 + i], blocks=([i + 1], []), prompt_logprobs=1 if rid in "bd" else None)
    assert b.gather_scheduled({"a", "b"}) == 2
    assert b.req_ids[:5] == ["a", "b", "c", "d", "e"]  # already in place: nothing moves
    assert b.gather_scheduled({"a", "d", "e"}) == 3
    # b and c (rows 1, 2) are not scheduled; d and e (rows 3, 4) take their rows.
    assert b.req_ids[0] == "a" and set(b.req_ids[1:3]) == {"d", "e"} and set(b.req_ids[3:5]) == {"b", "c"}
    for rid, i in zip("abcde", range(5), strict=True):
        row = b.req_id_to_index[rid]
        assert b.req_ids[row] == rid and b.token_ids[row, 0] == 10 + i and b.block_ids(rid, 0) == [i + 1]
        assert b.sampling.prompt_token_ids[row] == [10 + i]
    assert b.prompt_logprobs == {b.req_id_to_index["b"]: 1, b.req_id_to_index["d"]: 1}
    assert b.gather_scheduled({}) == 0


def test_update_request_zeroes_removed_columns_before_appending() -> None:
    b = make_batch()
    add(b, "a", list(range(3, 13)), computed=8, blocks=([5, 6, 7], [9]))
    b.update_request("a", 9, [[0, 1], []], [[8], [4]])
    assert b.num_computed_tokens[0] == 9
    assert b.block_ids("a", 0) == [0, 0, 7, 8] and b.block_ids("a", 1) == [9, 4]
    # A removed index is into the list as it was: column 4 does not exist yet, so clearing it first is a
    # no-op and the block appended there stays (clearing after appending would null it).
    b.update_request("a", 10, [[4], []], [[11], []])
    assert b.block_ids("a", 0) == [0, 0, 7, 8, 11]
    b.update_request("a", 11, None, None)  # nothing removed, nothing new
    assert b.block_ids("a", 0) == [0, 0, 7, 8, 11] and b.num_computed_tokens[0] == 11


def test_append_token_extends_the_row_and_the_sampling_state() -> None:
    b = make_batch()
    add(b, "a", [3, 4], outputs=[5])
    add(b, "b", [6])
    b.append_token(1, 42)
    b.append_token(0, 43)
    b.append_token(0, 44)
    assert b.token_ids[0, :5].tolist() == [3, 4, 5, 43, 44] and b.num_tokens[0] == 5
    assert b.num_prompt_tokens[0] == 2
    assert b.token_ids[1, :2].tolist() == [6, 42] and b.num_tokens[1] == 2
    assert b.sampling.output_token_ids[0] == [5, 43, 44] and b.sampling.output_token_ids[1] == [42]


def test_swap_rows_carries_everything() -> None:
    b = make_batch()
    add(b, "a", [3, 4, 5], computed=2, blocks=([1, 2], [3]), temperature=0.0, prompt_logprobs=3)
    add(b, "b", [6], outputs=[7], computed=1, blocks=([4], []), temperature=0.9)
    b.swap_rows(0, 1)
    assert b.req_ids[:2] == ["b", "a"] and b.req_id_to_index == {"b": 0, "a": 1}
    assert b.token_ids[0, :2].tolist() == [6, 7] and b.token_ids[1, :3].tolist() == [3, 4, 5]
    assert b.num_tokens[:2].tolist() == [2, 3] and b.num_prompt_tokens[:2].tolist() == [1, 3]
    assert b.num_computed_tokens[:2].tolist() == [1, 2]
    assert b.block_ids("a", 0) == [1, 2] and b.block_ids("a", 1) == [3] and b.block_ids("b", 1) == []
    assert b.sampling.is_greedy[:2] == [False, True] and b.prompt_logprobs == {1: 3}


# ---------------------------------------------------------------- InputBatch, random operations


class InputBatchMachine(RuleBasedStateMachine):
    """Random adds, removals, swaps, gathers, updates and appended tokens against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = make_batch()
        self.model: dict[str, dict] = {}
        self.next_id = 0

    def _blocks_fit(self, rid: str, new: list[list[int]]) -> bool:
        blocks = self.model[rid]["blocks"]
        return all(len(blocks[g]) + len(ids) <= MAX_BLOCKS[g] for g, ids in enumerate(new))

    @precondition(lambda self: len(self.model) < MAX_REQS)
    @rule(
        prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=8),
        outputs=st.lists(st.integers(3, VOCAB - 1), max_size=4),
        blocks=st.tuples(
            st.lists(st.integers(1, 99), max_size=MAX_BLOCKS[0] - 2),
            st.lists(st.integers(1, 99), max_size=MAX_BLOCKS[1] - 1),
        ),
        prompt_logprobs=st.one_of(st.none(), st.integers(0, 3)),
        data=st.data(),
    )
    def add(self, prompt, outputs, blocks, prompt_logprobs, data) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        computed = data.draw(st.integers(0, len(prompt) + len(outputs)))
        temperature = round(0.05 * (self.next_id % 19 + 1), 2)  # a fingerprint of the request
        row = self.batch.add_request(
            rid,
            prompt,
            outputs,
            computed,
            [list(ids) for ids in blocks],
            params(temperature, prompt_logprobs, stop_token_ids=[self.next_id % VOCAB]),
            eos_token_id=2,
        )
        assert row == len(self.model)
        self.model[rid] = dict(
            prompt=list(prompt),
            outputs=list(outputs),
            computed=computed,
            blocks=[list(ids) for ids in blocks],
            temperature=temperature,
            prompt_logprobs=prompt_logprobs,
        )

    @rule(data=st.data())
    def remove(self, data) -> None:
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model) + ["unknown"]), unique=True))
        before = {r: self.batch.req_id_to_index[r] for r in self.model}
        self.batch.remove_requests(gone)
        for rid in gone:
            self.model.pop(rid, None)
        # Rows before the first hole never move.
        holes = [before[r] for r in gone if r in before]
        first = min(holes, default=len(before))
        for rid, row in before.items():
            if row < first and rid in self.model:
                assert self.batch.req_id_to_index[rid] == row, rid

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def swap(self, data) -> None:
        a, b = data.draw(st.lists(st.integers(0, len(self.model) - 1), min_size=2, max_size=2, unique=True))
        ra, rb = self.batch.req_ids[a], self.batch.req_ids[b]
        self.batch.swap_rows(a, b)
        assert self.batch.req_ids[a] == rb and self.batch.req_ids[b] == ra

    @rule(data=st.data())
    def gather(self, data) -> None:
        scheduled = set()
        if self.model:
            scheduled = set(data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True)))
        before = {r: self.batch.req_id_to_index[r] for r in self.model}
        n = self.batch.gather_scheduled(scheduled)
        assert n == len(scheduled) and set(self.batch.req_ids[:n]) == scheduled
        # Only misplaced requests move: a scheduled one already in [0, n) and an unscheduled one already
        # at n or beyond keep their rows.
        for rid, row in before.items():
            if (rid in scheduled) == (row < n):
                assert self.batch.req_id_to_index[rid] == row, rid

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def update(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[rid]
        computed = data.draw(st.integers(0, len(m["prompt"]) + len(m["outputs"])))
        removed = None
        if data.draw(st.booleans()):
            removed = [
                data.draw(st.lists(st.integers(0, len(ids) - 1), unique=True)) if ids else []
                for ids in m["blocks"]
            ]
        new = None
        if data.draw(st.booleans()):
            new = [data.draw(st.lists(st.integers(1, 99), max_size=2)) for _ in MAX_BLOCKS]
            if not self._blocks_fit(rid, new):
                new = None
        self.batch.update_request(rid, computed, removed, new)
        m["computed"] = computed
        for g, cols in enumerate(removed or []):
            for j in cols:
                m["blocks"][g][j] = 0
        for g, ids in enumerate(new or []):
            m["blocks"][g].extend(ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), token=st.integers(3, VOCAB - 1))
    def append_token(self, data, token) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[rid]
        if len(m["prompt"]) + len(m["outputs"]) < MAX_LEN:
            self.batch.append_token(self.batch.req_id_to_index[rid], token)
            m["outputs"].append(token)

    @invariant()
    def every_row_holds_its_request(self) -> None:
        b, n = self.batch, len(self.model)
        assert b.num_reqs == n and set(b.req_ids[:n]) == set(self.model)
        assert b.req_ids[n:] == [None] * (MAX_REQS - n)
        assert b.req_id_to_index == {rid: b.req_ids.index(rid) for rid in self.model}
        assert b.sampling.occupied == [True] * n + [False] * (MAX_REQS - n)
        want_prompt_logprobs = {}
        for rid, m in self.model.items():
            row = b.req_id_to_index[rid]
            tokens = m["prompt"] + m["outputs"]
            assert b.token_ids[row, : len(tokens)].tolist() == tokens, rid
            assert (b.num_tokens[row], b.num_prompt_tokens[row]) == (len(tokens), len(m["prompt"]))
            assert b.num_computed_tokens[row] == m["computed"]
            assert [b.block_ids(rid, g) for g in range(len(MAX_BLOCKS))] == m["blocks"]
            assert b.sampling.prompt_token_ids[row] == m["prompt"]
            assert b.sampling.output_token_ids[row] == m["outputs"]
            assert b.sampling.temperature[row].item() == pytest.approx(m["temperature"])
            if m["prompt_logprobs"] is not None:
                want_prompt_logprobs[row] = m["prompt_logprobs"]
        assert b.prompt_logprobs == want_prompt_logprobs


InputBatchMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_input_batch_random_operations = InputBatchMachine.TestCase
