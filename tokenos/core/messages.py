"""The messages between the frontend (process 0) and the engine core (process 1): typed, msgpack on the wire.

Every message is a msgspec Struct, so it crosses ZeroMQ as msgpack and is decoded ONCE, straight into
its type: the engine core never sees an untyped dict. The frontend validates a request fully before it
sends it (`tokenos.engine.input_processor`); the core keeps only the checks it must own itself
(`tokenos.core.validation`), since any client may reach it.

- `EngineSamplingParams`: what the engine core and the worker need of a user's `SamplingParams` (no
  stop strings, no detokenization options: those stay in the frontend). ``stop_token_ids`` is the user's
  list, unchanged. Text never crosses: the user's ``bad_words`` arrive tokenized by the frontend
  (``bad_words_token_ids``), and ``extra_args`` is passed through untouched to the engine's logits
  processors (`tokenos.sample.logits_processor`).
- `EngineCoreRequest`: one sample of one request (the frontend fans n > 1 out into n of them). The EOS
  ids of the model's generation config other than ``eos_token_id`` travel in their own field,
  ``extra_eos_token_ids``: they end a request like EOS (unless ``ignore_eos``, and not below
  ``min_tokens``) and are reported as its ``stop_reason``.
- `EngineCoreOutput(s)`: what a step produced for each request that got tokens, prompt logprobs, or
  finished, plus the step's stats.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # client went away, or an error

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class StructuredSpec(msgspec.Struct, frozen=True, array_like=True):
    """A grammar the output must follow (see tokenos.structured): kind is one of
    tokenos.sampling_params.STRUCTURED_KINDS; text the schema / regex / choice list / grammar."""

    kind: str
    text: str


class EngineSamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, kw_only=True):
    """How the engine core samples one request's tokens and when it stops them (token-level rules)."""

    temperature: float = 1.0  # < 1e-5: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = None  # None: no cap besides max_model_len
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None
    # With a reasoning parser: where the output starts (tokenos.reasoning.ReasoningState; 0: no parser).
    # The grammar constrains only what follows the thinking.
    reasoning: int = 0
    # Only these ids may be sampled (None: any); applied before every other sampling stage.
    allowed_token_ids: list[int] | None = None
    # The user's bad words as token-id sequences (each with and without a leading space, as vLLM
    # tokenizes them): when the output ends with all but the last id of one, its last id is banned.
    bad_words_token_ids: list[list[int]] | None = None
    # Arbitrary user arguments for the engine's custom logits processors (vLLM's extra_args).
    extra_args: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    eos_token_id: int | None = None
    # The generation config's other EOS ids (see the module docstring).
    extra_eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # n > 1: the samples after the first name the first one; the scheduler forks them from it
    # once it has computed the shared prompt (see tokenos.core.sched.forks).
    fork_of: str | None = None
    # Multi-LoRA: the name of a loaded adapter to run under (None: the base model).
    lora_name: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    # Per new token: [ids, logprobs, rank] with ids[0] the chosen token.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    finish_reason: int | None = None  # FinishReason value
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set (with finish_reason ABORT) when the engine failed this request alone: what went wrong.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    # Per-step counters the frontend aggregates into metrics.
    stats: dict | None = None
