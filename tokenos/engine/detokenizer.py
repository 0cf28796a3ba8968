"""Incremental detokenization: token ids in, text deltas out, stop strings found on the way.

The text of one new token is not the decode of that token alone: byte-level BPE splits a
character's UTF-8 bytes across tokens, and sentencepiece decoders drop the leading space of the
first token they see. So we decode a short sliding window twice (vLLM's scheme): the tokens
already emitted since `prefix_offset` (`prefix_text`), and the same plus the new ones
(`full_text`); the new text is what `full_text` adds. When it ends in U+FFFD the character is not
complete yet, so nothing is emitted and the window grows until it is (or the request ends, when
whatever is there is flushed, so the final text equals decoding all ids at once).

Stop strings can span tokens. After each update we search the text that could hold a new match;
on a match the text is cut there (keeping the stop string if `include_stop_str_in_output`) and the
matched string is returned: the caller finishes the request. Until the request ends, the last
len(longest stop) - 1 characters are held back from `output_text`, so a stop string that is still
being formed is never shown and then retracted; shown text only ever grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenos.sampling_params import SamplingParams

# Prompt tokens kept as decoding context: enough for a sentencepiece leading space and for any
# multi-token character at the prompt's end.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # With the stop string kept in the output, a match never cuts shown text, so no hold-back.
        longest = max((len(s) for s in self.stop), default=0)
        self.hold_back = 0 if self.include_stop_str_in_output else max(longest - 1, 0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._window_ids = context  # prompt tail + generated ids; only [prefix_offset:] is ever decoded
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_token_ids: list[int] = []
        self._text = ""
        self._delta_sent = 0
        self.finished = False
        self.stop_reason: str | None = None

    # ------------------------------------------------------------ feeding

    def update(self, new_token_ids: Sequence[int], finished: bool) -> str | None:
        """Take this step's new tokens. Returns the stop string that matched (the request must
        finish), else None. `finished`: the engine ended the request (EOS, length, abort)."""
        if self.stop_reason is not None:
            return None  # already stopped: tokens that raced the abort are ignored
        text_start = len(self._text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._text += self._decode_next(token_id)
        if finished:
            self._text += self._flush()
        stop = self._check_stop_strings(text_start)
        self.finished = finished or stop is not None
        return stop

    def _decode_next(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        new_text = self._pending_text()
        if not new_text or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or a skipped special token): wait for more
        self._advance()
        return new_text

    def _flush(self) -> str:
        """The text of ids still held back as incomplete, replacement characters and all."""
        new_text = self._pending_text()
        self._advance()
        return new_text

    def _pending_text(self) -> str:
        ids = self._window_ids
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(ids[self.prefix_offset :])
        # Decoding is prefix-consistent for a fixed window start, so the new text is the tail.
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _advance(self) -> None:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._window_ids)
        # Drop ids before the window so memory stays constant over long generations.
        if self.prefix_offset > 64:
            del self._window_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop_strings(self, new_text_start: int) -> str | None:
        """Cut the text at the earliest stop string that ends in the new text."""
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None  # vLLM: stop strings count only once min_tokens are generated
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self._text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self._text = self._text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        self.stop_reason = stop
        return stop

    # ------------------------------------------------------------ reading

    @property
    def output_text(self) -> str:
        """All text safe to show: everything once finished, else minus the stop-string hold-back."""
        if self.finished or not self.hold_back:
            return self._text
        return self._text[: max(len(self._text) - self.hold_back, 0)]

    def get_delta(self) -> str:
        """Text not returned by an earlier `get_delta` call."""
        text = self.output_text
        delta = text[self._delta_sent :]
        self._delta_sent = len(text)
        return delta

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
