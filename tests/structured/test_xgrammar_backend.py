"""The optional xgrammar backend (``structured_outputs_backend="xgrammar"``) under the same checks as
llguidance: every kind in one batch with free requests, hundreds of temperature-1 samples of a nested
schema that must all validate, EBNF grammars, tokenizer-free checks at the front door, and the matcher's
rollback and draft validation. (The nested schema's bounded strings found an xgrammar 0.2.8 bug, raw
control characters inside maxLength strings, that the backend mends: `_json_strings_without_controls`.)
Skipped where xgrammar is not installed (it is an optional extra)."""

from __future__ import annotations

import re

import pytest

from tests.fixtures.checkpoints import save_served
from tests.structured.test_structured_output import (
    CHOICES,
    PERSON,
    PHONE,
    check,
    check_nested_samples,
    params,
)
from tokenos import LLM
from tokenos.core.messages import StructuredSpec
from tokenos.core.validation import InvalidRequestError
from tokenos.engine.args import EngineArgs
from tokenos.sampling_params import StructuredOutputsParams as SO
from tokenos.structured.backend import GrammarError, backend_name, check_grammar

pytest.importorskip("xgrammar")

EBNF = 'root ::= "The answer is " [0-9] "."'
KINDS = {
    "json": SO(json=PERSON, disable_any_whitespace=True),
    "regex": SO(regex=PHONE),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=EBNF),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    folder = save_served("llama", str(tmp_path_factory.mktemp("tiny-llama")))
    return LLM(folder, dtype="float32", max_model_len=512, structured_outputs_backend="xgrammar")


def test_every_kind_in_one_batch_beside_free_requests(llm):
    free = [[5, 6, 7, 8, 9]]
    (alone,) = llm.generate(
        [{"prompt_token_ids": p} for p in free], params(None, max_tokens=12), use_tqdm=False
    )
    prompts = [f"Answer {k}: " for k in KINDS] + [{"prompt_token_ids": p} for p in free]
    outs = llm.generate(
        prompts, [params(so) for so in KINDS.values()] + [params(None, max_tokens=12)], use_tqdm=False
    )
    for kind, out in zip(KINDS, outs, strict=False):
        check(kind, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_sampled_answers_validate_against_a_nested_schema(llm):
    check_nested_samples(llm, num_prompts=25, seed=5)  # 200 samples


def test_the_front_door_checks_against_xgrammar(llm):
    with pytest.raises(InvalidRequestError, match="Unclosed"):
        llm.generate("x", params(SO(regex="[0-9")))
    # Lark is llguidance's grammar language, not xgrammar's
    with pytest.raises(InvalidRequestError, match="structured output"):
        llm.generate("x", params(SO(grammar='start: "a"')))
    check_grammar(StructuredSpec("grammar", EBNF), "xgrammar")
    with pytest.raises(GrammarError, match="Unsupported type"):
        check_grammar(StructuredSpec("json", '{"type": "nope"}'), "xgrammar")


def test_backend_names():
    assert backend_name(None) == backend_name("auto") == backend_name("llguidance") == "guidance"
    assert backend_name("xgrammar") == "xgrammar"
    with pytest.raises(ValueError, match="outlines"):
        EngineArgs(structured_outputs_backend="outlines").create_configs()


def test_matcher_rollback_and_draft_validation():
    from tokenos.engine.tokenizer import load_tokenizer
    from tokenos.structured.xgrammar_backend import XGrammarBackend

    tokenizer = load_tokenizer(None)
    backend = XGrammarBackend(tokenizer.hf, 49152, [2])
    matcher = backend.matcher(backend.compile(StructuredSpec("regex", "[0-9]{3}-[0-9]{4}")))
    draft = tokenizer.encode("123-4567", add_special_tokens=False)
    assert matcher.validate(draft + tokenizer.encode("x", add_special_tokens=False)) == len(draft)
    assert matcher.validate(tokenizer.encode("12a", add_special_tokens=False)) < 3
    for token in draft:
        assert matcher.accept(token)
    assert matcher.is_terminated()
    matcher.rollback(len(draft))
    assert not matcher.is_terminated() and matcher.accept(draft[0])
    assert re.fullmatch(PHONE, "123-4567")


def test_a_request_may_name_only_the_servers_backend():
    from tokenos.entrypoints.openai.protocol import CompletionRequest, OpenAIError

    body = {"prompt": "x", "guided_regex": "[0-9]+", "guided_decoding_backend": "xgrammar"}
    request = CompletionRequest.model_validate(body)
    assert request.to_sampling_params("xgrammar").structured_outputs.regex == "[0-9]+"
    with pytest.raises(OpenAIError, match="this server uses guidance"):
        request.to_sampling_params("guidance")


def test_terminated_when_only_a_stop_token_is_left():
    """As llguidance: `[a-z]+` goes on after a letter (it could end, but need not); a choice ends on its
    last token."""
    from tokenos.engine.tokenizer import load_tokenizer
    from tokenos.structured.xgrammar_backend import XGrammarBackend

    tokenizer = load_tokenizer(None)
    backend = XGrammarBackend(tokenizer.hf, 49152, [2])
    letters = backend.matcher(backend.compile(StructuredSpec("regex", "[a-z]+")))
    for token in tokenizer.encode("abc", add_special_tokens=False):
        assert letters.accept(token) and not letters.is_terminated()
    assert letters.accept(2) and letters.is_terminated()  # the stop token ends it
    choice = backend.matcher(backend.compile(StructuredSpec("choice", '["yes"]')))
    tokens = tokenizer.encode("yes", add_special_tokens=False)
    for token in tokens[:-1]:
        assert choice.accept(token) and not choice.is_terminated()
    assert choice.accept(tokens[-1]) and choice.is_terminated()
