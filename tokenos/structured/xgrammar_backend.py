"""xgrammar as a grammar backend (``--structured-outputs-backend xgrammar``), behind the same two
protocols as llguidance (`tokenos.structured.backend`).

The spec kinds map to xgrammar's compilers: a JSON schema (its llguidance ``x-guidance`` whitespace
option becomes ``any_whitespace``), a regex, a choice (an EBNF alternation of JSON-escaped literals) and
a grammar, which for this backend is EBNF (GBNF), as vLLM's xgrammar backend takes it (llguidance takes
Lark). A matcher terminates once its grammar admits nothing but a stop token, as llguidance's does, so
both stop a request on the same token. Draft validation is accept-then-rollback (xgrammar has no dry
run).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from tokenos.core.messages import StructuredSpec
from tokenos.structured.backend import GrammarError, Matcher

_ANY_OBJECT = '{"type": "object"}'


def _schema_and_whitespace(text: str) -> tuple[str, bool]:
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise GrammarError("invalid json for structured output: a JSON schema must be an object")
    options = schema.pop("x-guidance", None) or {}
    return json.dumps(schema), bool(options.get("whitespace_flexible", True))


def choice_ebnf(choices_json: str) -> str:
    """An EBNF grammar matching exactly one of the choices (a JSON list of strings)."""
    choices = json.loads(choices_json)
    return "root ::= " + " | ".join(json.dumps(str(c), ensure_ascii=False) for c in choices)


def _grammar(spec: StructuredSpec, compile_with: Any) -> Any:
    """The compiled (or, with xgrammar.Grammar, parsed) grammar of ``spec``: ``compile_with`` is a
    GrammarCompiler, or the Grammar class to only check it."""
    import xgrammar

    checking = compile_with is xgrammar.Grammar
    if spec.kind in ("json", "json_object"):
        schema, any_ws = _schema_and_whitespace(spec.text if spec.kind == "json" else _ANY_OBJECT)
        grammar = _json_strings_without_controls(
            xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_ws)
        )
        return grammar if checking else compile_with.compile_grammar(grammar)
    if spec.kind == "regex":
        return (compile_with.from_regex if checking else compile_with.compile_regex)(spec.text)
    if spec.kind in ("choice", "grammar"):
        ebnf = choice_ebnf(spec.text) if spec.kind == "choice" else spec.text
        return (compile_with.from_ebnf if checking else compile_with.compile_grammar)(ebnf)
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (maxLength / minLength) as
# [^"\\\r\n], which admits the other control characters, and JSON forbids them raw: a random model
# produced "name": "...\x18". Its unbounded strings exclude \0-\x1f; this gives the bounded ones the same.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_strings_without_controls(grammar: Any) -> Any:
    import xgrammar

    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def xgrammar_error(spec: StructuredSpec) -> str | None:
    """Why ``spec`` does not compile under xgrammar (None: it does), without a tokenizer."""
    import xgrammar

    try:
        _grammar(spec, xgrammar.Grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        return f"invalid {spec.kind} for structured output: {_reason(e)}"
    return None


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class XGrammarMatcher:
    """xgrammar's matcher, terminated as llguidance's is: when the grammar admits nothing but a stop
    token (xgrammar itself terminates only on the stop token, or, asked to terminate without one, as soon
    as the grammar could end, which would cut ``[a-z]+`` after one letter). Whether anything but a stop
    token is left is read off the next mask, which is kept for the next step."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import torch

        self._m = matcher
        self._torch = torch
        self._stop = list(matcher.stop_token_ids)
        self._next = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._next_valid = False
        self._done = False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._next_valid:
            bitmask[row] = self._next[0]
        else:
            self._m.fill_next_token_bitmask(self._torch.from_numpy(bitmask), row)

    def accept(self, token_id: int) -> bool:
        self._next_valid = False
        if self._done or not self._m.accept_token(token_id):
            return False
        if self._m.is_completed() and not self._m.is_terminated():
            self._m.fill_next_token_bitmask(self._torch.from_numpy(self._next), 0)
            self._next_valid = True
            self._done = not _allows_other_than(self._next[0], self._stop)
        return True

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        self._next_valid = self._done = False

    def validate(self, token_ids: list[int]) -> int:
        accepted = 0
        for token in token_ids:
            if self._m.is_terminated() or not self._m.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._m.rollback(accepted)
        return accepted

    def is_terminated(self) -> bool:
        return self._done or bool(self._m.is_terminated())

    def error(self) -> str | None:
        return None


def _allows_other_than(row: np.ndarray, stop_ids: list[int]) -> bool:
    """Whether a mask row allows any token outside ``stop_ids``."""
    words = row.copy()
    for token in stop_ids:
        if (token >> 5) < words.size:
            words[token >> 5] &= ~np.int32(np.uint32(1 << (token & 31)).view(np.int32))
    return bool(words.any())


class XGrammarBackend:
    """xgrammar over the model's Hugging Face tokenizer, masks as wide as the model's vocab."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredSpec) -> Any:
        try:
            return _grammar(spec, self.compiler)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"invalid {spec.kind} for structured output: {_reason(e)}") from None

    def matcher(self, compiled: Any) -> Matcher:
        import xgrammar

        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled), self.vocab_size)
