"""The request checks the engine core owns: a request that can never run is refused, with one message.

The frontend's front door (`tokenos.engine.input_processor`) calls the same functions before it sends a
request, so a user sees exactly one message per fault, whichever door they came in by; the engine core
calls them again on every request it receives, because any client of its socket may reach it.
`InvalidRequestError` carries the name of the request field at fault (``param``), which the HTTP layer
puts in its 400 body.
"""

from __future__ import annotations

from collections.abc import Sequence


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
