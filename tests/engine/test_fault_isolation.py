"""One request's fault hurts no one else in the engine core: a hostile request is refused at the door of
process 1 (whatever client sent it), and a failure attributable to one request in the middle of a batch
(its sampling) ends that request alone while every other one finishes with its exact greedy text."""

from __future__ import annotations

import math

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import make_llm, random_prompts
from tokenos import SamplingParams
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams
from tokenos.sample.sampler import Sampler

POISON_TOP_K = 77  # the request whose sampling the test makes fail


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "llama")
    save_tiny("llama", folder, perturbed=False, **LLM_SHAPE)
    return make_llm(folder)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kwargs)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": math.inf},
        {"temperature": 1e300},
        {"repetition_penalty": math.nan},
        {"top_k": 2**63},
        {"seed": 2**64},
        {"logit_bias": {5: math.nan}},
        {"logit_bias": {10**6: 1.0}},
        {"stop_token_ids": [10**6]},
        {"logprobs": 10**6},
    ],
)
def test_the_engine_core_refuses_what_its_kernels_cannot_represent(llm, bad):
    """Sent straight to the core (as any client of its socket could), past every frontend check."""
    params = EngineSamplingParams(**{"max_tokens": 4, **bad})
    request = EngineCoreRequest(request_id="hostile", prompt_token_ids=[5, 6, 7], sampling_params=params)
    with pytest.raises(ValueError) as e:
        llm.engine.add_request(request)
    assert getattr(e.value, "param", None) == next(iter(bad))
    assert not llm.engine.has_unfinished_requests()


def test_a_sampling_failure_ends_that_request_alone(llm, monkeypatch):
    prompts = random_prompts(4, 5, 30, seed=3, vocab=LLM_SHAPE["vocab_size"])
    clean = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)

    original = Sampler.__call__

    def failing(self, logits, metadata):
        k = metadata.top_k
        if k is not None and bool((k == POISON_TOP_K).any()):
            raise RuntimeError("injected sampling failure")
        return original(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", failing)
    # The poisoned request samples randomly (so top_k is active) and runs in the same batches as the others.
    params = [greedy()] * 4 + [SamplingParams(temperature=1.0, top_k=POISON_TOP_K, max_tokens=12, seed=1)]
    poisoned = prompts[1][:-1] + [9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, poisoned]], params, use_tqdm=False)

    for want, got in zip(clean, outputs[:4], strict=True):
        assert got.error is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "length"
    failed = outputs[4]
    assert failed.error is not None and "injected sampling failure" in failed.error
    assert failed.outputs[0].finish_reason == "abort"
    # the engine is clean and keeps serving: no request left behind, every block back in the pool
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_metrics()["kv_cache_usage"] == 0.0
    monkeypatch.setattr(Sampler, "__call__", original)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in clean]
