"""The custom logits processor machinery (tokenos/sample/logits_processor): the one `BatchUpdate` per step
against a model that applies it literally (removed, added, moved, in order), the dict helper vLLM's
processors use, loading classes and "module:Class" strings, and the one-row view the fault-isolation
path samples with."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.logits_processors import TokenRuleProcessor
from tokenos.core.messages import EngineSamplingParams
from tokenos.core.validation import InvalidRequestError
from tokenos.sample.logits_processor import (
    BatchUpdate,
    EngineConfig,
    LogitsProcessors,
    MoveDirectionality,
    batch_update,
    load_logits_processors,
    process_dict_updates,
    validate_logits_processor_params,
)


def replay(before: list[int], update: BatchUpdate) -> dict[int, int]:
    """What a processor keyed by row holds after applying ``update`` in vLLM's order."""
    rows = dict(enumerate(before))
    for row in update.removed:
        del rows[row]
    for row, key, _prompt, _output in update.added:
        rows[row] = key
    for a, b, direction in update.moved:
        if direction == MoveDirectionality.SWAP:
            rows[a], rows[b] = rows[b], rows[a]
        else:
            assert b not in rows, "a one-way move must land on an empty row"
            rows[b] = rows.pop(a)
    return rows


def describe(now: list[int]):
    return lambda row, index: (index, now[row], None, [])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_batch_update_turns_before_into_now(data) -> None:
    keys = data.draw(st.lists(st.integers(0, 30), unique=True, max_size=12))
    before = keys[: data.draw(st.integers(0, len(keys)))]
    rest = data.draw(st.permutations(keys))
    now = rest[: data.draw(st.integers(0, len(rest)))]
    update = batch_update(before, now, describe(now))
    if before == now:
        assert update is None
        return
    assert update.batch_size == len(now)
    added_rows = [entry[0] for entry in update.added]
    assert not set(added_rows) & set(update.removed), "an added row is never also reported removed"
    assert all(0 <= row < len(now) for row in added_rows)
    assert replay(before, update) == dict(enumerate(now))
    assert len(update.moved) <= len(now)


def test_batch_update_cases() -> None:
    # The usual step: nothing moved.
    assert batch_update([1, 2, 3], [1, 2, 3], describe([1, 2, 3])) is None
    # A request finished, the last row filled its hole, a new one was appended.
    # The new one takes the hole (row 0: no longer reported removed), and a swap puts both in place.
    u = batch_update([1, 2, 3], [3, 2, 4], describe([3, 2, 4]))
    assert u.removed == [] and [a[:2] for a in u.added] == [(0, 4)]
    assert u.moved == [(2, 0, MoveDirectionality.SWAP)]
    # A request not scheduled this step leaves the processors' batch (removed), and comes back (added).
    u = batch_update([1, 2], [2], describe([2]))
    assert u.removed == [0] and u.moved == [(1, 0, MoveDirectionality.UNIDIRECTIONAL)]
    u = batch_update([2], [2, 1], describe([2, 1]))
    assert u.removed == [] and [a[:2] for a in u.added] == [(1, 1)] and u.moved == []


def test_process_dict_updates_follows_rows() -> None:
    entries: dict[int, str] = {0: "a", 2: "c"}
    update = BatchUpdate(
        batch_size=3,
        removed=[0],
        added=[(0, "x", None, []), (3, None, None, [])],
        moved=[(2, 1, MoveDirectionality.SWAP), (3, 2, MoveDirectionality.UNIDIRECTIONAL)],
    )
    assert process_dict_updates(entries, update, lambda params, _p, _o: params)
    assert entries == {0: "x", 1: "c"}
    assert not process_dict_updates(entries, None, lambda *_: None)


def test_load_classes_and_strings() -> None:
    spec = "tests.fixtures.logits_processors:TokenRuleProcessor"
    assert load_logits_processors([spec, TokenRuleProcessor]) == [TokenRuleProcessor, TokenRuleProcessor]
    assert load_logits_processors(None) == [] and load_logits_processors(spec) == [TokenRuleProcessor]
    for bad, match in [
        ("tests.fixtures.logits_processors.TokenRuleProcessor", "module:ClassName"),
        ("no.such.module:X", "cannot import"),
        ("tests.fixtures.logits_processors:Nope", "has no"),
        (dict, "not a subclass"),
        ("tests.fixtures.logits_processors:process_dict_updates", "not a subclass"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_logits_processors([bad])


def test_validate_params_names_the_processor() -> None:
    validate_logits_processor_params(
        [TokenRuleProcessor], EngineSamplingParams(extra_args={"force_token_id": 3})
    )
    with pytest.raises(InvalidRequestError, match="TokenRuleProcessor refused") as e:
        validate_logits_processor_params(
            [TokenRuleProcessor], EngineSamplingParams(extra_args={"force_token_id": "x"})
        )
    assert e.value.param == "extra_args"


def test_one_row_view_puts_the_row_where_the_processor_expects_it() -> None:
    config = EngineConfig(SimpleNamespace(vocab_size=8), SimpleNamespace(max_num_seqs=4), None)
    proc = TokenRuleProcessor(config, torch.device("cpu"), False)
    params = EngineSamplingParams(extra_args={"force_token_id": 5})
    proc.update_state(BatchUpdate(3, [], [(2, params, None, [])], []))
    procs = LogitsProcessors([proc])
    assert procs.non_argmax_invariant == [proc] and procs.argmax_invariant == []
    rng = random.Random(0)
    batch = torch.tensor([[rng.random() for _ in range(8)] for _ in range(3)])
    whole = procs.apply_each(procs.non_argmax_invariant, batch.clone())
    for row in range(3):
        view = procs.for_row(row, 3)
        alone = view.apply_each(view.non_argmax_invariant, batch[row : row + 1].clone())
        assert torch.equal(alone, whole[row : row + 1])
    assert torch.isinf(whole[2]).sum() == 7 and whole[2, 5] == batch[2, 5]
