"""The persistent batch tells the custom logits processors its changes: after random adds, removals
(holes condensed), preemptions (a request re-added with its output so far), unscheduled requests left
beyond the step's rows and the swaps that gather the scheduled ones, a processor that mirrors the batch
from the updates alone holds exactly the batch's rows [0, n), each with its request's live output list."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tests.fixtures.logits_processors import RecordingProcessor
from tokenos.core.messages import EngineSamplingParams
from tokenos.sample.logits_processor import EngineConfig, LogitsProcessors
from tokenos.worker.input_batch import InputBatch

MAX_REQS, VOCAB = 6, 50
CONFIG = EngineConfig(SimpleNamespace(vocab_size=VOCAB), SimpleNamespace(max_num_seqs=MAX_REQS), None)


def make_batch() -> tuple[InputBatch, RecordingProcessor]:
    recorder = RecordingProcessor(CONFIG, torch.device("cpu"), False)
    return InputBatch(MAX_REQS, 64, [8], VOCAB, logitsprocs=LogitsProcessors([recorder])), recorder


def add(batch: InputBatch, rid: str, outputs: list[int] = ()) -> None:
    params = EngineSamplingParams(extra_args={"tag": rid})
    batch.add_request(rid, [3, 4], list(outputs), 0, ([],), params, eos_token_id=2)


def check(batch: InputBatch, recorder: RecordingProcessor, n: int) -> None:
    assert recorder.tags() == {row: batch.req_ids[row] for row in range(n)}
    for row, (_tag, output) in recorder.rows.items():
        assert output is batch.sampling.output_token_ids[row], "the processor must hold the live list"


def test_no_change_is_none_and_no_processors_is_nothing() -> None:
    batch, recorder = make_batch()
    add(batch, "a")
    batch.update_logits_processors(1)
    batch.update_logits_processors(1)
    assert recorder.updates[0] is not None and recorder.updates[1] is None
    plain = InputBatch(MAX_REQS, 64, [8], VOCAB, logitsprocs=LogitsProcessors())
    assert plain.logitsprocs is None and plain.sampling.logitsprocs is None
    plain.update_logits_processors(0)


def test_preempted_request_comes_back_with_its_output() -> None:
    batch, recorder = make_batch()
    add(batch, "a")
    add(batch, "b")
    batch.update_logits_processors(2)
    batch.append_token(0, 7)
    assert recorder.rows[0][1] == [7]  # the live list: the processor sees the new token
    batch.remove_requests(["a"])  # preempted
    add(batch, "a", outputs=[7])  # resumed: a new request for the processors, with its output replayed
    batch.gather_scheduled({"a", "b"})
    batch.update_logits_processors(2)
    update = recorder.updates[-1]
    assert [(params.extra_args["tag"], out) for _row, params, _, out in update.added] == [("a", [7])]
    check(batch, recorder, 2)


@pytest.mark.parametrize("seed", range(40))
def test_random_steps_keep_the_processors_in_step(seed) -> None:
    rng = random.Random(seed)
    batch, recorder = make_batch()
    names = iter(f"r{i}" for i in range(10_000))
    for _ in range(30):
        live = [r for r in batch.req_ids[: batch.num_reqs]]
        finished = [r for r in live if rng.random() < 0.2]
        preempted = [r for r in live if r not in finished and rng.random() < 0.1]
        batch.remove_requests(finished + preempted)
        for rid in preempted:  # some resume at once, with their output so far
            if rng.random() < 0.5:
                add(batch, rid, outputs=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))])
        while batch.num_reqs < MAX_REQS and rng.random() < 0.6:
            add(batch, next(names))
        live = [r for r in batch.req_ids[: batch.num_reqs]]
        scheduled = {r for r in live if rng.random() < 0.8}
        n = batch.gather_scheduled(scheduled)
        batch.update_logits_processors(n)
        check(batch, recorder, n)
        for row in range(n):
            batch.append_token(row, rng.randrange(VOCAB))
