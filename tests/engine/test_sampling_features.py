"""allowed_token_ids, bad_words, truncate_prompt_tokens and extra_args at the front door: the user's
checks (`SamplingParams`), the model's (vocabulary, context), vLLM's tokenization of bad words with
SmolLM2's real tokenizer, truncation before the length check, what crosses to the engine core per sample
(msgpack round trip), and the custom logits processors' own checks."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from tokenos.core.messages import EngineCoreRequest
from tokenos.core.validation import MAX_BAD_WORDS, InvalidRequestError
from tokenos.engine.input_processor import InputProcessor, Prompt
from tokenos.sampling_params import SamplingParams

PROCESSOR = "tests.fixtures.logits_processors:TokenRuleProcessor"


def door(tokenizer=None, max_model_len: int = 64, vocab_size: int = 1000, **kwargs) -> InputProcessor:
    config = SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab_size, eos_token_ids=(2,))
    return InputProcessor(tokenizer, config, **kwargs)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
        ({"extra_args": ["x"]}, "extra_args"),
        ({"extra_args": {1: "x"}}, "extra_args"),
        ({"extra_args": {"x": object()}}, "extra_args"),
        ({"extra_args": {"x": "y" * 70_000}}, "extra_args"),
    ],
)
def test_user_checks_name_the_field(kwargs, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_normal_forms() -> None:
    p = SamplingParams(bad_words=["a", "b", "a"], allowed_token_ids=(3, 4), truncate_prompt_tokens=-1)
    assert p.bad_words == ["a", "b"] and p.allowed_token_ids == [3, 4]
    assert SamplingParams().bad_words == [] and SamplingParams().allowed_token_ids is None


def test_model_checks() -> None:
    d = door()
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        d.process("r", [5, 6], SamplingParams(allowed_token_ids=[3, 1000]))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init") as e:
        d.process("r", [5, 6], SamplingParams(bad_words=["x"]))
    assert e.value.param == "bad_words"


def test_truncation_keeps_the_last_tokens_before_the_length_check() -> None:
    d = door(max_model_len=16)
    prompt = list(range(3, 43))  # 40 tokens: too long for the context untruncated
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        d.process("r", prompt, SamplingParams())
    req = d.process("r", prompt, SamplingParams(truncate_prompt_tokens=10))
    assert req.prompt.token_ids == prompt[-10:] == req.engine_requests[0].prompt_token_ids
    # -1: as many as the model can run (one position is left to generate).
    assert d.process("r", prompt, SamplingParams(truncate_prompt_tokens=-1)).prompt.token_ids == prompt[-15:]
    assert (
        d.process("r", prompt[:5], SamplingParams(truncate_prompt_tokens=10)).prompt.token_ids == prompt[:5]
    )
    with pytest.raises(InvalidRequestError, match="greater than max_model_len") as e:
        d.process("r", prompt, SamplingParams(truncate_prompt_tokens=17))
    assert e.value.param == "truncate_prompt_tokens"
    text = d.truncate(Prompt(prompt, "its text"), SamplingParams(truncate_prompt_tokens=3))
    assert text == Prompt(prompt[-3:], "its text")  # the text is kept, as vLLM keeps it


def test_bad_words_tokenized_as_vllm_does(smollm2) -> None:
    d = door(smollm2, vocab_size=len(smollm2))

    def enc(text: str) -> list[int]:
        return smollm2.encode(text, add_special_tokens=False)

    # Each word alone and after a space (when that is another token sequence of the same length).
    assert d.bad_words_token_ids(["hello", " world"]) == [
        enc("hello"),
        enc(" hello"),
        enc("world"),
        enc(" world"),
    ]
    for word in ["hello world", "Paris", "antidisestablishment"]:
        alone, spaced = enc(word), enc(" " + word)
        want = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        assert d.bad_words_token_ids([word]) == want
    req = d.process("r", "Say hi", SamplingParams(bad_words=["hello"], n=2, seed=1))
    assert all(
        r.sampling_params.bad_words_token_ids == [enc("hello"), enc(" hello")] for r in req.engine_requests
    )


def test_what_crosses_to_the_engine_core_per_sample() -> None:
    extra = {"force_token_id": 7, "nested": {"a": [1, 2]}}
    params = SamplingParams(n=3, seed=5, allowed_token_ids=[7, 8], extra_args=extra)
    req = door().process("r", [5, 6], params)
    decode = msgspec.msgpack.Decoder(EngineCoreRequest).decode
    for sample in req.engine_requests:
        wire = decode(msgspec.msgpack.encode(sample)).sampling_params
        assert (
            wire.allowed_token_ids == [7, 8] and wire.extra_args == extra and wire.bad_words_token_ids is None
        )
    # Each sample has its own copy of extra_args, not the caller's dict.
    extra["nested"]["a"].append(3)
    assert req.engine_requests[0].sampling_params.extra_args["nested"]["a"] == [1, 2]


def test_logits_processors_check_the_request_at_the_front_door() -> None:
    d = door(logits_processors=[PROCESSOR])
    d.process("r", [5, 6], SamplingParams(extra_args={"force_token_id": 7}))
    with pytest.raises(InvalidRequestError, match="TokenRuleProcessor refused.*force_token_id") as e:
        d.process("r", [5, 6], SamplingParams(extra_args={"force_token_id": "seven"}))
    assert e.value.param == "extra_args"
    with pytest.raises(ValueError, match="module:ClassName"):
        door(logits_processors=["not a spec"])
