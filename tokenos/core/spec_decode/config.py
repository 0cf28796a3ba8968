"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked.

vLLM's keys are accepted as they are spelled there (`method`, `num_speculative_tokens`,
`prompt_lookup_min`, `prompt_lookup_max`, `disable_by_batch_size`, for "suffix" the
`suffix_decoding_*` keys, and for "draft_model" the drafter's `model`: a local HF folder or GGUF file); a
method or key tokenos does not build is refused, never ignored, since it would change what the user gets.
Method "mtp" drafts with the target checkpoint's own multi-token-prediction layer, so it takes no `model`
and none of the token-only proposers' keys. The drafter itself is checked against the target where it is
loaded (`tokenos.worker.draft_model`, `tokenos.worker.mtp`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model", "mtp")
# Methods whose drafts come from a model in the worker (`ModelRunnerOutput.draft_token_ids`).
WORKER_METHODS = ("draft_model", "mtp")
# Built in vLLM, not here yet: refused by name so the error says so.
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator")
# The keys method "mtp" reads; any other would be silently meaningless for it.
_MTP_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
# Running requests above which a step schedules no drafts. Measured (bench throughput, copy-32, n-gram
# k=4, acceptance length 3.0, 2-vCPU AMD EPYC with AVX-512-BF16): always-on speculation against none at
# max_num_seqs 1 / 2 / 4 / 8 / 16 gave 2.13x / 1.91x / 1.34x / 0.98x / 0.96x, so past 8 decodes a step's
# linears are compute-bound and the drafts' extra rows cost what the accepted ones save.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_FLOAT_KEYS = ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # For "suffix" a maximum: the proposer picks each draft's length (vLLM defaults it to the tree depth).
    num_speculative_tokens: int | None = None
    # vLLM's resolution: one given, the other equals it; neither, both 5 (`__post_init__`).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # Suffix decoding (vLLM's names and defaults).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # "draft_model": the drafter's checkpoint (a local HF folder or GGUF file), same tokenizer as the target.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(
                f"speculative method {self.method!r} is not built in tokenos yet; use one of {list(METHODS)}."
            )
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {list(METHODS)}.")
        if self.method == "mtp" and self.model is not None:
            raise ValueError(
                'speculative method "mtp" drafts with the target checkpoint\'s own MTP layer: '
                'speculative_config.model does not apply (use method "draft_model" for a separate drafter).'
            )
        if self.method != "mtp" and (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'speculative_config.model (the drafter) is required by method "draft_model" and not '
                f"supported with method {self.method!r}."
            )
        if self.num_speculative_tokens is None:
            # MTP: vLLM's default, one draft per MTP layer (the released checkpoints have one).
            defaults = {"suffix": self.suffix_decoding_max_tree_depth, "mtp": 1}
            default = defaults.get(self.method, 4)
            object.__setattr__(self, "num_speculative_tokens", default)
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else hi if hi is not None else 5)
        object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else self.prompt_lookup_min)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}.")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1 and max_cached_requests >= 0.")
        if self.suffix_decoding_max_spec_factor < 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_max_spec_factor must be >= 0 and min_token_prob in [0, 1].")

    @property
    def lookahead_slots(self) -> int:
        """Slots past a request's tokens its worker drafter writes K/V into while proposing: a draft
        model's k one-token forwards at P .. P + k - 1; the MTP's first draft comes from the step's own
        positions, so only drafts 2..k take a slot each."""
        if self.method == "draft_model":
            return self.num_speculative_tokens
        if self.method == "mtp":
            return self.num_speculative_tokens - 1
        return 0

    @property
    def kv_reads_next_token(self) -> bool:
        """Whether the drafter's K/V at position i depends on token i + 1 (MTP: it reads the target's
        hidden state at i beside the embedding of i + 1), so a prefix hit must end before the last token
        the cached pages are known to share (`KVCacheManager.get_computed_blocks`)."""
        return self.method == "mtp"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict (offline `LLM(speculative_config=...)`) or its JSON text (`--speculative-config`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config keys {unknown} are not supported by tokenos "
                f"(supported: {sorted(known)})."
            )
        if "method" not in value:
            raise ValueError(f'speculative_config needs a "method" (one of {list(METHODS)}).')
        if value["method"] == "mtp":
            extra = sorted(set(value) - set(_MTP_KEYS) - {"model"})  # model: refused with its own message
            if extra:
                raise ValueError(
                    f'speculative_config keys {extra} do not apply to method "mtp" '
                    f"(it reads {list(_MTP_KEYS)})."
                )
        for key, v in value.items():
            kinds = (int, float) if key in _FLOAT_KEYS else (int,)
            if key == "model":
                if not isinstance(v, str) or not v:
                    raise ValueError(f"speculative_config.model must be a checkpoint path, got {v!r}.")
                continue
            if key != "method" and (isinstance(v, bool) or not isinstance(v, kinds)):
                raise ValueError(f"speculative_config.{key} must be a number, got {v!r}.")
        return cls(**value)
