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
        def bad(msg: str) -> ValueError:
            return ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad(f"logprobs must be >= 0, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
