"""The request checks the engine core owns: a request that can never run is refused, with one message.

The frontend's front door (`tokenos.engine.input_processor`) and `SamplingParams` call the same functions
before a request is sent, so a user sees exactly one message per fault, whichever door they came in by;
the engine core calls them again on every request it receives, because any client of its socket may
reach it. A request that passes them is representable by every kernel: floats finite and within float32,
integers within int64, token ids within the vocabulary (``logit_bias``, ``stop_token_ids``,
``allowed_token_ids``, the tokenized ``bad_words``), top-n counts within the vocabulary, lists bounded,
``extra_args`` a msgpack-encodable dict (it crosses the process boundary to the logits processors).
Nothing a request carries can then fail a step for everyone. `InvalidRequestError` carries the name of
the request field at fault (``param``), which the HTTP layer puts in its 400 body.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Bounds on the per-request lists the sampler reads every step (a whole vocabulary may be allowed).
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 128  # strings; each may become two token sequences (with and without a leading space)
MAX_BAD_WORD_TOKENS = 128  # tokens of one bad word
MAX_EXTRA_ARGS_BYTES = 1 << 16  # extra_args as msgpack


class InvalidRequestError(ValueError):
    """A request that can never run, and why. ``param`` names the field at fault (None: the request)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str, param: str) -> None:
    """InvalidRequestError unless every id is in the vocabulary ``[0, vocab_size)``."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{what} id {bad} is outside the vocabulary [0, {vocab_size}).", param)


def check_prompt_tokens(
    token_ids: Sequence[int], max_model_len: int, vocab_size: int, param: str = "prompt"
) -> None:
    """InvalidRequestError unless the prompt can run: non-empty, room for one answer token, ids known."""
    n = len(token_ids)
    if n == 0:
        raise InvalidRequestError("The prompt is empty: give at least one token.", param)
    if n >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len), but the "
            f"prompt has {n} tokens (one position must be left to generate). Please shorten it.",
            param,
        )
    check_token_ids(token_ids, vocab_size, "Prompt token", param)


def check_int(name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    """InvalidRequestError unless ``value`` is an integer (not a bool) in ``[lo, hi]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}.", name)
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{name} must be an integer in [{lo}, {hi}], got {value}.", name)


def check_float(
    name: str, value: Any, lo: float = -FLOAT32_MAX, hi: float = FLOAT32_MAX, lo_open: bool = False
) -> None:
    """InvalidRequestError unless ``value`` is a finite real number in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``); the bounds default to what float32 holds."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}.", name)
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequestError(f"{name} must be a finite number in {interval}, got {value}.", name)


def check_sampling_values(params: Any) -> None:
    """The value rules of the sampling fields `SamplingParams` and the engine's `EngineSamplingParams`
    share (both have these attribute names)."""
    check_float("temperature", params.temperature, 0.0)
    check_float("top_p", params.top_p, 0.0, 1.0, lo_open=True)
    check_int("top_k", params.top_k, -1)
    check_float("min_p", params.min_p, 0.0, 1.0)
    if params.seed is not None:
        check_int("seed", params.seed)
    check_float("presence_penalty", params.presence_penalty, -2.0, 2.0)
    check_float("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    check_float("repetition_penalty", params.repetition_penalty, 0.0, lo_open=True)
    for token_id, bias in (params.logit_bias or {}).items():
        check_int("logit_bias", token_id)
        check_float("logit_bias", bias)
    if params.max_tokens is not None:
        check_int("max_tokens", params.max_tokens, 1)
    check_int("min_tokens", params.min_tokens, 0)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens}).",
            "min_tokens",
        )
    for token_id in params.stop_token_ids or ():
        check_int("stop_token_ids", token_id)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            check_int(name, value, 0)
    if params.allowed_token_ids is not None:
        check_allowed_token_ids(params.allowed_token_ids)
    # The engine's tokenized bad words (the user's strings are checked by SamplingParams).
    bad_words = getattr(params, "bad_words_token_ids", None)
    if bad_words is not None:
        check_bad_words_token_ids(bad_words)
    if params.extra_args is not None:
        check_extra_args(params.extra_args)


def check_allowed_token_ids(token_ids: Any) -> None:
    """A non-empty, bounded list of integers (vLLM refuses an empty list: nothing could be sampled)."""
    if not isinstance(token_ids, list) or not token_ids:
        raise InvalidRequestError(
            "allowed_token_ids must be a non-empty list of token ids (or null for no restriction).",
            "allowed_token_ids",
        )
    if len(token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequestError(
            f"allowed_token_ids has {len(token_ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS}.",
            "allowed_token_ids",
        )
    for token_id in token_ids:
        check_int("allowed_token_ids", token_id)


def check_bad_words_token_ids(sequences: Any) -> None:
    """Bounded non-empty token-id sequences: the tokenized bad words the sampler matches every step."""
    if not isinstance(sequences, list) or len(sequences) > 2 * MAX_BAD_WORDS:
        raise InvalidRequestError(f"bad_words must be a list of at most {MAX_BAD_WORDS} words.", "bad_words")
    for ids in sequences:
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
            raise InvalidRequestError(
                f"Every bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens long.", "bad_words"
            )
        for token_id in ids:
            check_int("bad_words", token_id)


def check_extra_args(extra_args: Any) -> None:
    """A dict with string keys whose values msgpack can carry (JSON-like), bounded in size: it crosses the
    process boundary to the engine core's logits processors."""
    if not isinstance(extra_args, dict) or any(not isinstance(k, str) for k in extra_args):
        raise InvalidRequestError("extra_args must be a dict with string keys.", "extra_args")
    try:
        size = len(msgspec.msgpack.encode(extra_args))
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidRequestError(
            f"extra_args must hold only JSON-like values (numbers, strings, lists, dicts, ...): {e}",
            "extra_args",
        ) from None
    if size > MAX_EXTRA_ARGS_BYTES:
        raise InvalidRequestError(
            f"extra_args is {size} bytes as msgpack; at most {MAX_EXTRA_ARGS_BYTES}.", "extra_args"
        )


def resolve_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens to keep (the last ones), vLLM's rule: None keeps all, -1 as many as the
    model can run, k at most max_model_len. tokenos leaves one position to generate, so -1 keeps
    ``max_model_len - 1`` tokens (vLLM's max_model_len would leave a prompt no room for an answer)."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len - 1
    if truncate_prompt_tokens > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than max_model_len "
            f"({max_model_len}). Please select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def check_sampling_for_model(params: Any, vocab_size: int, max_logprobs: int) -> None:
    """What the sampling fields must also satisfy for one model: token ids in its vocabulary, top-n
    logprob counts at most ``max_logprobs`` (and the vocabulary)."""
    if params.logit_bias:
        check_token_ids(list(params.logit_bias), vocab_size, "logit_bias token", "logit_bias")
    check_token_ids(params.stop_token_ids or (), vocab_size, "stop_token_ids token", "stop_token_ids")
    if params.allowed_token_ids:
        check_token_ids(params.allowed_token_ids, vocab_size, "allowed_token_ids token", "allowed_token_ids")
    for ids in getattr(params, "bad_words_token_ids", None) or ():
        check_token_ids(ids, vocab_size, "bad_words token", "bad_words")
    limit = min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise InvalidRequestError(f"{name} must be at most {limit}, got {value}.", name)
