"""What the sampler needs to know about one step's batch, as tensors plus a few flags.

Built by `SamplingState.make_metadata` from the persistent per-row store. Row i of every tensor
is row i of the logits. The `no_*` / `all_*` flags let the sampler skip whole stages (a batch of
greedy requests without penalties is one argmax). Optional tensors are None when no row uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    num_reqs: int
    # Temperature per row; greedy rows hold 1.0 so dividing by it is harmless.
    temperature: torch.Tensor  # float32 [num_reqs]
    greedy_mask: torch.Tensor  # bool [num_reqs]
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int64 [num_reqs], vocab-or-larger where off; None if no row uses it
    top_p: torch.Tensor | None  # float32 [num_reqs], 1.0 where off
    min_p: torch.Tensor | None  # float32 [num_reqs], 0.0 where off
    # row -> its own generator: seeded rows draw only from it, so their samples do not depend on
    # what else is in the batch. Unseeded random rows share the default generator.
    generators: dict[int, torch.Generator]
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # float32 [num_reqs]
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # Prompt ids of rows with a repetition penalty, padded with -1 ([num_reqs, max_len]).
    prompt_token_ids: torch.Tensor | None
    # The state's live lists (appended to as tokens are sampled); only read when penalties are on.
    output_token_ids: list[list[int]]
    # Logit bias as a sparse (rows, token ids, values) triple, or None.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Rows still below min_tokens -> token ids to forbid this step (EOS and stop_token_ids).
    min_tokens: dict[int, list[int]] = field(default_factory=dict)
    # Top-n logprobs per row (None: none wanted); max over rows, None when no row wants any.
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
