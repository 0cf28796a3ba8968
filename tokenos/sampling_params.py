"""How one request wants its tokens chosen and when it stops: the user's `SamplingParams`, shaped like vLLM's.

Pure Python (no torch). Every check a user can fail without knowing the model lives in `__post_init__`,
so bad input is rejected at once with a ValueError that says what to change; the checks against the
model (token ids in the vocabulary, the context length) are the front door's
(`tokenos.engine.input_processor`), which also turns these parameters into the engine core's own
`EngineSamplingParams`: it truncates the prompt (``truncate_prompt_tokens``) and tokenizes the
``bad_words``; ``allowed_token_ids`` and ``extra_args`` (read by the engine's custom logits processors,
`tokenos.sample.logits_processor`) travel as they are.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from tokenos.core.validation import MAX_BAD_WORDS, InvalidRequestError, check_int, check_sampling_values

# Bounds on what one request may carry (lists bounded, as every field is).
MAX_N = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORD_CHARS = 1024


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request ends


# Grammar kinds the engine core compiles (tokenos.structured): the vLLM names of StructuredOutputsParams.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar, vLLM's ``StructuredOutputsParams``: set exactly one of a JSON
    schema (``json``: a dict or its JSON text), any JSON object (``json_object=True``), a regular
    expression, a choice among strings, or a context-free grammar (Lark, or GBNF / EBNF as llguidance
    reads them). Masks applied before sampling make every other token unpickable; the request stops
    when the grammar is complete."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens (vLLM's option): small models can otherwise loop on it.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "Structured outputs take exactly one of json, json_object, regex, choice or grammar; "
                f"got {given or 'none'}.",
                "structured_outputs",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings.", "choice")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{kind} must be a non-empty string.", kind)
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequestError("json must be a JSON schema (an object or its JSON text).", "json")
        if len(self.spec()[1]) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"The grammar is longer than {MAX_GRAMMAR_CHARS} characters.", "grammar"
            )

    def spec(self) -> tuple[str, str]:
        """(kind, text): what the engine core compiles; a schema or a choice as JSON text."""
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json is None else self.json
            if not self.disable_any_whitespace:
                return ("json", schema if isinstance(schema, str) else json.dumps(schema))
            if isinstance(schema, str):
                schema = _json_object(schema)
            # llguidance reads its options from the schema's "x-guidance" key.
            return "json", json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", str(self.grammar)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"json is not valid JSON: {e}", "json") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("json must be a JSON schema object.", "json")
    return value


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Only these token ids may be sampled (every other logit is -inf before any other stage).
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated: the last token of a word's tokens is banned whenever the output
    # ends with the tokens before it (a one-token word is always banned). vLLM's semantics.
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (-1: as many as the model can run); None keeps the prompt whole.
    truncate_prompt_tokens: int | None = None
    # Arbitrary arguments for the engine's custom logits processors (LLM(logits_processors=[...])).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        # vLLM's normal form: a list without repeats ([] when none).
        if isinstance(self.bad_words, list | tuple):
            self.bad_words = list(dict.fromkeys(self.bad_words))
        elif self.bad_words is None:
            self.bad_words = []
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._verify()

    def _verify(self) -> None:
        check_int("n", self.n, 1, MAX_N)
        check_sampling_values(self)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings.", "stop")
        if len(self.stop) > MAX_STOP_STRINGS or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"At most {MAX_STOP_STRINGS} stop strings and {MAX_STOP_TOKEN_IDS} stop_token_ids.", "stop"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams.", "structured_outputs"
            )
        self._verify_bad_words()
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise InvalidRequestError(
                    "truncate_prompt_tokens must be an integer >= 1, or -1 (as many as the model can run).",
                    "truncate_prompt_tokens",
                )

    def _verify_bad_words(self) -> None:
        words = self.bad_words
        if not isinstance(words, list) or any(
            not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words
        ):
            raise InvalidRequestError(
                f"bad_words must be a list of non-blank strings of at most {MAX_BAD_WORD_CHARS} characters.",
                "bad_words",
            )
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"At most {MAX_BAD_WORDS} bad_words, got {len(words)}.", "bad_words")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
