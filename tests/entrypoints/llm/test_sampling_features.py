"""allowed_token_ids, bad_words, truncate_prompt_tokens and a custom logits processor end to end through
the offline `LLM`: a tiny random-weight Llama with SmolLM2's real tokenizer. The random model spreads its
probability over the whole vocabulary, so a logit bias makes the words these tests ban likely: without
the ban they appear in most samples, with it never. Requests that use none of the features get exactly
the tokens they get alone, also when they share a batch with ones that do; the features hold under
chunked prefill, preemption (outputs replayed) and n > 1."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import save_served
from tokenos import LLM, SamplingParams
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams

PROCESSOR = "tests.fixtures.logits_processors:TokenRuleProcessor"
PROMPT = "The weather today is"
HELLO, SPACE_HELLO, SPACE_WORLD, WORLD = 28120, 33662, 905, 6693  # SmolLM2's ids
IS = 314  # " is": what the random model picks greedily after PROMPT


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=256, logits_processors=[PROCESSOR])


@pytest.fixture(scope="module")
def tight(folder) -> LLM:
    """Small steps (prompts in chunks) and a pool for about two requests: preemption by recompute."""
    return LLM(
        folder,
        dtype="float32",
        max_model_len=96,
        num_kv_blocks=9,
        block_size=16,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
        logits_processors=[PROCESSOR],
    )


def texts(llm: LLM, params: SamplingParams, prompt=PROMPT) -> list[str]:
    return [c.text for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    return [c.token_ids for out in llm.generate(prompts, params_list, use_tqdm=False) for c in out.outputs]


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 16, "ignore_eos": True, **kwargs})


def test_allowed_token_ids(llm) -> None:
    allowed = [HELLO, SPACE_WORLD, WORLD, 1000, 20_000]
    for ids in token_ids(llm, [PROMPT], sampled(n=8, seed=1, allowed_token_ids=allowed)):
        assert set(ids) <= set(allowed) and len(ids) == 16
    (greedy,) = token_ids(llm, [PROMPT], sampled(temperature=0.0, allowed_token_ids=allowed))
    assert set(greedy) <= set(allowed)
    assert IS in token_ids(llm, [PROMPT], sampled(temperature=0.0))[0]  # unconstrained it says " is"


def test_bad_word_never_appears(llm) -> None:
    bias = {HELLO: 10.0, SPACE_HELLO: 10.0}
    for seed in range(3):
        free = texts(llm, sampled(n=16, seed=seed, logit_bias=bias))
        banned = texts(llm, sampled(n=16, seed=seed, logit_bias=bias, bad_words=["hello"]))
        assert sum("hello" in t for t in free) >= 12
        assert not any("hello" in t for t in banned), banned


def test_multi_token_bad_word_bans_only_its_completion(llm) -> None:
    bias = {HELLO: 12.0, SPACE_HELLO: 12.0, SPACE_WORLD: 12.0}
    free = texts(llm, sampled(n=16, seed=4, logit_bias=bias))
    banned = texts(llm, sampled(n=16, seed=4, logit_bias=bias, bad_words=["hello world"]))
    assert sum("hello world" in t for t in free) >= 12
    assert not any("hello world" in t for t in banned), banned
    # vLLM's semantics: the word's first token is still allowed, only the completion is banned.
    assert sum("hello" in t for t in banned) >= 12


def test_truncate_prompt_tokens_equals_the_truncated_prompt(llm) -> None:
    ids = llm.get_tokenizer().encode("A long prompt about the weather, the sea and the mountains today")
    params = sampled(temperature=0.0, max_tokens=8)
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}], sampled(temperature=0.0, max_tokens=8, truncate_prompt_tokens=5)
    )
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == token_ids(llm, [{"prompt_token_ids": ids[-5:]}], params)[0]
    # -1 keeps as much as the model can run: a prompt longer than the context still gets its answer.
    (long,) = llm.generate(
        [{"prompt_token_ids": ids * 30}], sampled(truncate_prompt_tokens=-1), use_tqdm=False
    )
    assert len(long.prompt_token_ids) == 255 and len(long.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([PROMPT], sampled(truncate_prompt_tokens=257), use_tqdm=False)


def test_logits_processor_per_request_and_mixed_batches(llm) -> None:
    prompts = [PROMPT, "Once upon a time", PROMPT, "Hello there", "Numbers: 1, 2, 3", "The sea is"]
    features = [
        sampled(temperature=0.0, extra_args={"force_token_id": 1234}),
        sampled(temperature=0.0),  # plain, greedy
        sampled(temperature=0.0, extra_args={"ban_token_ids": [IS]}),
        sampled(seed=3, top_p=0.9),  # plain, seeded
        sampled(seed=5, allowed_token_ids=[7, 8, 9], bad_words=["hello"], n=2),
        sampled(temperature=0.0, truncate_prompt_tokens=2),
    ]
    together = llm.generate(prompts, features, use_tqdm=False)
    assert together[0].outputs[0].token_ids == [1234] * 16
    assert IS not in together[2].outputs[0].token_ids
    assert all(set(c.token_ids) <= {7, 8, 9} for c in together[4].outputs)
    # Every request gets exactly what it gets alone, whatever else is in the batch.
    for prompt, params, out in zip(prompts, features, together, strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in out.outputs]
    # n > 1: every sample is forced (each has its own row in the processor).
    forced = token_ids(llm, [PROMPT], sampled(n=3, seed=2, extra_args={"force_token_id": 77}))
    assert forced == [[77] * 16] * 3


def test_features_hold_under_chunked_prefill_and_preemption(llm, tight) -> None:
    """A run with preemptions (outputs replayed, seeded generators going on where they were) matches the
    run without them token for token. Row 0: " world" is biased far above the rest and "world world" is
    a bad word, so every other token is banned, which holds after a preemption only if the replayed
    output is matched again."""
    prompts = [f"Story number {i}: once upon a time, in a land far away, there lived" for i in range(6)]
    hello = {HELLO: 12.0, SPACE_HELLO: 12.0}
    params = [
        sampled(temperature=0.0, max_tokens=40, logit_bias={SPACE_WORLD: 20.0}, bad_words=["world world"]),
        sampled(temperature=0.0, max_tokens=40, extra_args={"force_token_id": 4321}),
        sampled(temperature=0.0, max_tokens=40, allowed_token_ids=[11, 12, 13, 14]),
        sampled(seed=7, max_tokens=40, logit_bias=hello, bad_words=["hello"]),
        sampled(seed=8, max_tokens=40),
        sampled(
            seed=9, max_tokens=40, allowed_token_ids=[HELLO, WORLD, 99], extra_args={"ban_token_ids": [99]}
        ),
    ]
    want = token_ids(llm, prompts, params)
    got = token_ids(tight, prompts, params)
    assert tight.get_metrics()["num_preemptions"] > 0
    assert got == want
    world = want[0]
    assert world[::2] == [SPACE_WORLD] * 20 and SPACE_WORLD not in world[1::2]
    assert want[1] == [4321] * 40 and set(want[2]) <= {11, 12, 13, 14}
    assert not {HELLO, SPACE_HELLO} & set(want[3]) and set(want[5]) <= {HELLO, WORLD}


@pytest.mark.parametrize(
    "bad,param",
    [
        ({"extra_args": {"force_token_id": "x"}}, "extra_args"),  # the processor's validate_params
        ({"extra_args": {"x": object()}}, "extra_args"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[5, 10**6]]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
    ],
)
def test_engine_core_refuses_what_it_cannot_run(llm, bad, param) -> None:
    """Sent straight to the core (as any client of its socket could), past every frontend check."""
    request = EngineCoreRequest(
        request_id="hostile", prompt_token_ids=[5, 6, 7], sampling_params=EngineSamplingParams(**bad)
    )
    with pytest.raises(ValueError) as e:
        llm.engine.add_request(request)
    assert getattr(e.value, "param", None) == param
    assert not llm.engine.has_unfinished_requests()


def test_bad_processor_fails_at_start(folder) -> None:
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(folder, dtype="float32", max_model_len=64, num_kv_blocks=16, logits_processors=["nope:Nope"])
