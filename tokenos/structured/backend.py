"""Grammar backends behind one small interface: compile a grammar for a tokenizer, then per request a
matcher that fills bitmask rows, accepts tokens, rolls back, validates drafts and says when it is done.

llguidance is the default: a dependency-free wheel whose `LLMatcher` has rollback, draft validation
and forced-token queries, and whose masks cost tens of microseconds per token. xgrammar is the optional
second (`xgrammar_backend.py`, ``--structured-outputs-backend xgrammar``); its ``grammar`` kind is EBNF
where llguidance's is Lark.
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


# The backends, by the names vLLM gives them (``auto`` and ``llguidance`` mean guidance).
BACKENDS = ("guidance", "xgrammar")
_ALIASES = {"auto": "guidance", "llguidance": "guidance"}


def backend_name(name: str | None) -> str:
    """The canonical name of a backend; ValueError for one tokenos does not have."""
    canonical = _ALIASES.get(name or "auto", name)
    if canonical not in BACKENDS:
        raise ValueError(f"Unknown structured-output backend {name!r}; choose one of {list(BACKENDS)}.")
    return canonical


def check_backend_available(name: str | None) -> None:
    """ValueError for an unknown backend, or one whose package is not installed."""
    import importlib.util

    package = {"guidance": "llguidance", "xgrammar": "xgrammar"}[backend_name(name)]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"The {name} structured-output backend needs its package: pip install {package}")


def make_backend(name: str, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    if backend_name(name) == "xgrammar":
        from tokenos.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(hf_tokenizer, vocab_size, eos_token_ids)
    return LLGuidanceBackend(hf_tokenizer, vocab_size, eos_token_ids)


def check_grammar(spec: StructuredSpec, backend: str = "guidance") -> None:
    """GrammarError when ``spec`` cannot compile under ``backend``, without a tokenizer: what the front
    door checks so that a bad schema is a 400, not a request that fails later inside the engine."""
    message = _grammar_error(spec, backend_name(backend))
    if message:
        raise GrammarError(message)


# An HTTP request is checked by its protocol model and twice by the front door: the verdict is kept
# for the last few specs (a few, as a spec may be a megabyte of text).
@functools.lru_cache(maxsize=16)
def _grammar_error(spec: StructuredSpec, backend: str) -> str | None:
    if spec.kind == "json":
        try:
            json.loads(spec.text)
        except ValueError as e:
            return f"invalid {spec.kind} for structured output: {e}"
    if backend == "xgrammar":
        from tokenos.structured.xgrammar_backend import xgrammar_error

        return xgrammar_error(spec)
    import llguidance

    try:
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
