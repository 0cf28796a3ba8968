"""Frontend input processing: prompt -> token ids -> validated `EngineCoreRequest`s.

A request with n > 1 samples fans out here into n child requests (`{i}_{request_id}`) with
the same prompt; the engine core never sees n. Children 1..n-1 carry `fork_of` = child 0, so the
scheduler computes the prompt once and forks them from child 0 (attention pages shared by refcount,
recurrent state copied).
"""

from __future__ import annotations

import time
from typing import Any

from tokenos.core.outputs import EngineCoreRequest, sampling_params_to_dict
from tokenos.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def check_prompt_tokens(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """ValueError unless the prompt can run: non-empty, room for one answer token, ids in the vocabulary.
    The frontend checks before sending; the engine core checks again, as any client may reach it."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("The prompt is empty: give at least one token.")
    if n >= max_model_len:
        raise ValueError(
            f"The prompt is {n} tokens long, but the model's max_model_len is {max_model_len}: "
            "shorten the prompt (one position must be left for the answer)."
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).")


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


class Processor:
    def __init__(self, tokenizer, model_config) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.vocab_size
        self.eos_token_id = self._eos_token_id()
        self.extra_stop_ids = set(getattr(model_config, "eos_token_ids", None) or []) - {self.eos_token_id}

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            ids = getattr(self.model_config, "eos_token_ids", None) or []
            eos = ids[0] if ids else None
        return eos

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "This engine was started with skip_tokenizer_init: give prompt_token_ids, not text."
            )
        return self.tokenizer.encode(text)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError("A prompt dict needs 'prompt' (text) or 'prompt_token_ids'.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: give text or token ids.")

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        check_prompt_tokens(token_ids, self.max_model_len, self.vocab_size)
        if params.logit_bias:
            bad = next((t for t in params.logit_bias if not 0 <= int(t) < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})."
                )

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        self.validate_prompt(prompt_token_ids, params)
        params.all_stop_token_ids = set(params.stop_token_ids or []) | (
            set() if params.ignore_eos else self.extra_stop_ids
        )
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child = params if params.n == 1 else params.clone_for_sample(i)
            child_params = sampling_params_to_dict(child)
            child_params["stop_token_ids"] = sorted(params.all_stop_token_ids)
            rid = request_id if params.n == 1 else child_request_id(i, request_id)
            children.append(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=child_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    fork_of=children[0].request_id if children else None,
                )
            )
        return children
