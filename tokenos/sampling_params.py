"""How one request wants its tokens chosen and when it stops: the user's `SamplingParams`, shaped like vLLM's.

Pure Python (no torch). Every check a user can fail without knowing the model lives in `__post_init__`,
so bad input is rejected at once with a ValueError that says what to change; the checks against the
model (token ids in the vocabulary, the context length) are the front door's
(`tokenos.engine.input_processor`), which also turns these parameters into the engine core's own
`EngineSamplingParams`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenos.core.validation import InvalidRequestError, check_int, check_sampling_values

# Bounds on what one request may carry (lists bounded, as every field is).
MAX_N = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request ends


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
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

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
