"""Grammar backends behind one small interface: compile a grammar for a tokenizer, then per request a
matcher that fills bitmask rows, accepts tokens, rolls back, validates drafts and says when it is done.

llguidance is the default (and today the only) backend: a dependency-free wheel whose `LLMatcher` has
rollback, draft validation and forced-token queries, and whose masks cost tens of microseconds per
token. A second backend (xgrammar) would implement the same two protocols.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Protocol

import numpy as np

from tokenos.core.messages import StructuredSpec


class GrammarError(ValueError):
    """A grammar that does not compile (a bad schema, regex or grammar text); the message says why."""


class Matcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of an int32 [rows, ceil(vocab / 32)] bitmask: bit t set = token t allowed."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    def validate(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (a draft) the grammar accepts in a row, without advancing."""

    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more: the request stops."""

    def error(self) -> str | None:
        """Why the matcher failed (it then allows nothing), or None."""


class GrammarBackend(Protocol):
    def compile(self, spec: StructuredSpec) -> Any:
        """A compiled grammar (GrammarError when it does not compile); slow, run off the busy loop."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled``; cheap."""


def llguidance_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar text of a spec (not yet checked)."""
    import llguidance

    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.text)
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


def check_grammar(spec: StructuredSpec) -> None:
    """GrammarError when ``spec`` cannot compile, without a tokenizer: what the front door checks so
    that a bad schema is a 400, not a request that fails later inside the engine."""
    message = _grammar_error(spec)
    if message:
        raise GrammarError(message)


# An HTTP request is checked by its protocol model and twice by the front door: the verdict is kept
# for the last few specs (a few, as a spec may be a megabyte of text).
@functools.lru_cache(maxsize=16)
def _grammar_error(spec: StructuredSpec) -> str | None:
    import llguidance

    try:
        if spec.kind == "json":
            json.loads(spec.text)
        grammar = llguidance_grammar(spec)
    except (ValueError, TypeError) as e:
        return f"invalid {spec.kind} for structured output: {e}"
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return f"invalid {spec.kind} for structured output: {message}" if message else None


class LLGuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.size * v.itemsize)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def validate(self, token_ids: list[int]) -> int:
        return int(self._m.validate_tokens(token_ids))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend:
    """llguidance over the model's Hugging Face (fast) tokenizer, masks as wide as the model's vocab."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None
        )
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredSpec) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, llguidance_grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind} for structured output: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
