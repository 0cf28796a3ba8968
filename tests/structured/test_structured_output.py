"""Structured output end to end through the offline `LLM`: a tiny random-weight Llama with SmolLM2's
real tokenizer, so without the grammar masks its output would be noise; with them every answer must
parse, match and stop. Also the parameters, the front door's checks and the engine core's handling of
compile failures and aborts."""

from __future__ import annotations

import json
import re

import pytest

from tests.fixtures.checkpoints import save_served
from tokenos import LLM, SamplingParams
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams, FinishReason, StructuredSpec
from tokenos.core.validation import InvalidRequestError
from tokenos.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningState
from tokenos.sampling_params import StructuredOutputsParams as SO

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "active"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'start: "The answer is " DIGIT "."\nDIGIT: /[0-9]/'


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return LLM(folder, dtype="float32", max_model_len=512)


def check(kind: str, text: str) -> None:
    """The output follows its grammar exactly."""
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"name", "role", "active"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert value["role"] in ("admin", "user", "guest") and isinstance(value["active"], bool)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(r"The answer is [0-9]\.", text), text
    else:
        raise AssertionError(kind)


# A random model picks whitespace as happily as anything: compact JSON, so that it ends.
KINDS = {
    "json": SO(json=PERSON, disable_any_whitespace=True),
    "regex": SO(regex=PHONE),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=GRAMMAR),
}


def params(so: SO | None, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=so, **kwargs)


def test_params_take_exactly_one_grammar():
    assert SO(json=PERSON).spec() == ("json", json.dumps(PERSON))
    assert SO(choice=["a", "b"]).spec() == ("choice", '["a", "b"]')
    assert SO(json_object=True).spec() == ("json", '{"type": "object"}')
    compact = json.loads(SO(json=json.dumps(PERSON), disable_any_whitespace=True).spec()[1])
    assert compact == {**PERSON, "x-guidance": {"whitespace_flexible": False}}
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", 1]}, {"regex": ""}):
        with pytest.raises(InvalidRequestError):
            SO(**bad)
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_every_kind_in_one_batch_beside_free_requests(llm):
    """All kinds and two unconstrained requests in one batch: each constrained answer follows its
    grammar and stops by itself (finish_reason stop, far below max_tokens); the free requests get
    exactly the tokens they get alone (the masks touch only their own rows)."""
    free = [[5, 6, 7, 8, 9], [100, 200, 300]]
    alone = llm.generate([{"prompt_token_ids": p} for p in free], params(None, max_tokens=12), use_tqdm=False)
    prompts = [f"Answer {k}: " for k in KINDS] + [{"prompt_token_ids": p} for p in free]
    plist = [params(so) for so in KINDS.values()] + [params(None, max_tokens=12)] * 2
    outs = llm.generate(prompts, plist, use_tqdm=False)
    for kind, out in zip(KINDS, outs, strict=False):
        check(kind, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
    for a, b in zip(alone, outs[len(KINDS) :], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_json_object_sampled_n_samples_and_seeds(llm):
    """Sampling at temperature 1 (every token drawn from the masked distribution), n = 3 samples."""
    outs = llm.generate(
        ["Give me a person: ", "Phone: "],
        [
            params(KINDS["json"], temperature=1.0, n=3, seed=7),
            params(KINDS["regex"], temperature=1.0, n=3, seed=1),
        ],
        use_tqdm=False,
    )
    for kind, out in zip(["json", "regex"], outs, strict=True):
        assert len(out.outputs) == 3
        for sample in out.outputs:
            check(kind, sample.text)
    any_json = llm.generate(
        ["JSON: "], params(SO(json_object=True, disable_any_whitespace=True), max_tokens=200), use_tqdm=False
    )[0]
    if any_json.outputs[0].finish_reason == "stop":  # a random model may write an endless string
        check("json_object", any_json.outputs[0].text)


def test_chunked_prefill_prefix_hits_and_preemption(folder):
    """A small token budget (prompts in chunks), a repeated prompt (prefix hit) and a pool too small for
    all requests at once (preemption by recompute): every answer still follows its grammar."""
    llm = LLM(folder, dtype="float32", max_model_len=160, max_num_batched_tokens=32, num_kv_blocks=12)
    accounts = [f"Describe account {i} as JSON. " * 12 for i in (1, 1, 2)]  # 85 tokens, one repeated
    digits = SO(regex=r"[0-9]{100}")  # 100 tokens each: four of them outgrow the pool together
    prompts = accounts + [f"Digits {i}: " for i in range(4)]
    plist = [params(KINDS["json"])] * len(accounts) + [params(digits)] * 4
    outs = llm.generate(prompts, plist, use_tqdm=False)
    for out in outs[: len(accounts)]:
        check("json", out.outputs[0].text)
    for out in outs[len(accounts) :]:
        assert re.fullmatch(r"[0-9]{100}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] > 0
    assert metrics["num_preemptions"] > 0


def test_front_door_rejects_grammars_that_do_not_compile(llm):
    for so in (SO(regex="[0-9"), SO(json='{"type": "object", "properties": 5}'), SO(grammar="start: ???")):
        with pytest.raises(ValueError, match="structured output"):
            llm.generate(["x"], params(so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_engine_core_fails_a_bad_grammar_alone_and_aborts_pending(llm):
    """A client that skips the front door: the compile error ends that request with the error, the
    others run; a request aborted while its grammar compiles never runs."""
    core = llm.engine
    bad = EngineSamplingParams(temperature=0.0, max_tokens=5, structured=StructuredSpec("regex", "[0-9"))
    good = EngineSamplingParams(temperature=0.0, max_tokens=5)
    core.add_request(EngineCoreRequest(request_id="bad", prompt_token_ids=[5, 6], sampling_params=bad))
    core.add_request(EngineCoreRequest(request_id="good", prompt_token_ids=[5, 6], sampling_params=good))
    done = {}
    for _ in range(200):
        for out in core.step().outputs:
            if out.finished:
                done[out.request_id] = out
        if not core.has_unfinished_requests():
            break
    assert done["bad"].finish_reason == int(FinishReason.ABORT) and "structured output" in done["bad"].error
    assert done["good"].finish_reason == int(FinishReason.LENGTH) and done["good"].error is None
    choice = EngineSamplingParams(temperature=0.0, max_tokens=5, structured=StructuredSpec("choice", '["a"]'))
    core.add_request(EngineCoreRequest(request_id="gone", prompt_token_ids=[5], sampling_params=choice))
    # waiting for its grammar counts as waiting (vLLM's num_requests_waiting), deferred, not for capacity
    stats = core.get_stats()
    assert stats["num_waiting"] == 1 and stats["num_waiting_deferred"] == 1
    core.abort_requests(["gone"])
    assert not core.has_unfinished_requests() and core.get_stats()["num_waiting"] == 0


def test_grammar_with_stop_strings_penalties_and_min_tokens(llm):
    """Stop strings cut a constrained answer where they match; penalties and logit bias reshape the
    masked distribution without leaving it; the grammar's end finishes a request even before its
    min_tokens (every other token is unpickable)."""
    cut = llm.generate(["Phone: "], params(KINDS["regex"], stop=["-"]), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}", cut.text) and cut.finish_reason == "stop"
    shaped = llm.generate(
        ["Phone: "] * 2,
        [
            params(KINDS["regex"], repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
            params(KINDS["regex"], logit_bias={10407: 100.0}, temperature=0.8, seed=3),
        ],
        use_tqdm=False,
    )
    for out in shaped:
        check("regex", out.outputs[0].text)
    early = llm.generate(["x"], params(SO(choice=["yes"]), min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert early.text == "yes" and early.finish_reason == "stop"


NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "level": {"enum": ["low", "mid", "high"]},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": -50, "maximum": 50},
            "maxItems": 4,
        },
    },
    "required": ["id", "code", "level", "owner", "scores"],
    "additionalProperties": False,
}


def check_nested_samples(llm: LLM, num_prompts: int, seed: int) -> None:
    """8 temperature-1 samples of the nested schema per prompt: every one stops and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    outs = llm.generate(
        [f"Record {i}: " for i in range(num_prompts)],
        params(SO(json=NESTED, disable_any_whitespace=True), temperature=1.0, n=8, seed=seed, max_tokens=200),
        use_tqdm=False,
    )
    samples = [s for out in outs for s in out.outputs]
    assert len(samples) == 8 * num_prompts
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), NESTED)


def test_every_sampled_answer_validates_against_a_nested_schema(llm):
    """Temperature 1.0 over 320 samples of a random model: nested objects, arrays, enums, bounded
    integers, a string pattern, required fields; every answer must validate (jsonschema)."""
    check_nested_samples(llm, num_prompts=40, seed=11)


class MarkerParser(ReasoningParser):
    """Thinking between two of SmolLM2's single-token specials, so a logit bias can open or close it."""

    name = "test_markers"
    start = "<issue_start>"  # token 8
    end = "<issue_comment>"  # token 9
    default_state = ReasoningState.OPEN


@pytest.fixture
def thinking_llm(folder, monkeypatch) -> LLM:
    monkeypatch.setitem(REASONING_PARSERS, MarkerParser.name, MarkerParser)
    return LLM(folder, dtype="float32", max_model_len=512, reasoning_parser=MarkerParser.name)


def test_grammar_starts_after_the_thinking(thinking_llm, llm):
    """The end marker (token 9) is no JSON: only a free thinking can produce it; then the grammar."""
    so = SO(json_object=True, disable_any_whitespace=True)
    bias_end = params(so, logit_bias={9: 100.0}, max_tokens=80)
    thinking, ended = thinking_llm.generate(
        ["hello<issue_start>", "a<issue_start>b<issue_comment>"], bias_end
    )
    tokens = thinking.outputs[0].token_ids
    assert tokens[0] == 9 and 9 not in tokens[1:]
    answer = thinking_llm.tokenizer.decode(tokens[1:])
    assert isinstance(json.loads(answer), dict), answer
    # the prompt closed the thinking: the grammar from the first token
    assert ended.outputs[0].token_ids[0] != 9 and isinstance(json.loads(ended.outputs[0].text), dict)
    # without a reasoning parser the same request is constrained from the first token
    (plain,) = llm.generate(["hello<issue_start>"], bias_end)
    assert plain.outputs[0].token_ids[0] != 9 and isinstance(json.loads(plain.outputs[0].text), dict)


def test_open_output_may_start_thinking_and_is_then_free(thinking_llm):
    so = SO(json_object=True, disable_any_whitespace=True)
    (out,) = thinking_llm.generate(["hello"], params(so, logit_bias={8: 100.0}, max_tokens=6))
    # the start marker is allowed beside the grammar's first tokens; inside the thinking nothing binds
    assert out.outputs[0].token_ids == [8] * 6 and out.outputs[0].finish_reason == "length"


def test_speculative_drafts_under_a_grammar(folder, llm):
    """n-gram drafts for requests with a grammar: the drafts are cut where the grammar would refuse
    them and every verified position gets its own mask, so greedy output is token for token plain
    decoding's, every answer still follows its grammar, and drafts were proposed and accepted (a
    repetitive regex makes the answers repeat themselves)."""
    spec = LLM(
        folder,
        dtype="float32",
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    kinds = {**KINDS, "repeat": SO(regex=r"(na ){12}batman")}
    prompts = [f"Answer {k}: " for k in kinds]
    plist = [params(so) for so in kinds.values()]
    want = llm.generate(prompts, plist, use_tqdm=False)
    got = spec.generate(prompts, plist, use_tqdm=False)
    for kind, a, b in zip(kinds, want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, kind
        if kind != "repeat":
            check(kind, b.outputs[0].text)
    assert re.fullmatch(r"(na ){12}batman", got[-1].outputs[0].text)
    stats = spec.get_metrics()["spec_decoding"]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0, stats
