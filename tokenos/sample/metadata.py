"""What the sampler needs to know about one step's batch, as tensors plus a few flags.

Built by `SamplingState.make_metadata` from the persistent per-row store (or by `make_spec_metadata`,
with one row per draft position to verify). Row i of every tensor is row i of the logits. The
`no_*` / `all_*` flags let the sampler skip whole stages (a batch of greedy requests without penalties
is one argmax). Optional tensors are None when no row uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tokenos.sample.logits_processor.state import LogitsProcessors


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
    # Rows restricted to allowed ids: (rows, banned [rows, vocab] bool: True = not allowed), or None.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # Rows whose output ends with a bad word's prefix -> the last ids of those words (banned this step).
    bad_words: dict[int, list[int]] = field(default_factory=dict)
    # The engine's custom logits processors (None: there are none), fed the batch's changes each step.
    logitsprocs: LogitsProcessors | None = None

    @property
    def edits_logits(self) -> bool:
        """Whether a stage of `Sampler.process_logits` may change a logit of this batch."""
        return (
            self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.logit_bias is not None
            or bool(self.min_tokens)
            or (self.logitsprocs is not None and bool(self.logitsprocs.non_argmax_invariant))
            or not self.no_penalties
        )

    def select_row(self, row: int) -> SamplingMetadata:
        """The metadata of row ``row`` alone (as row 0), sharing its generator: to sample one row by
        itself when a batched sampling step failed."""

        def one(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[row : row + 1]

        bias = None
        if self.logit_bias is not None:
            rows, cols, vals = self.logit_bias
            keep = rows == row
            if bool(keep.any()):
                bias = (torch.zeros_like(rows[keep]), cols[keep], vals[keep])
        allowed = None
        if self.allowed_token_ids is not None:
            rows, banned = self.allowed_token_ids
            keep = rows == row
            if bool(keep.any()):
                allowed = (torch.zeros(1, dtype=rows.dtype, device=rows.device), banned[keep])
        procs = None if self.logitsprocs is None else self.logitsprocs.for_row(row, self.num_reqs)
        greedy = bool(self.greedy_mask[row])
        return replace(
            self,
            num_reqs=1,
            temperature=self.temperature[row : row + 1],
            greedy_mask=self.greedy_mask[row : row + 1],
            all_greedy=greedy,
            all_random=not greedy,
            top_k=one(self.top_k),
            top_p=one(self.top_p),
            min_p=one(self.min_p),
            generators={0: self.generators[row]} if row in self.generators else {},
            presence_penalties=one(self.presence_penalties),
            frequency_penalties=one(self.frequency_penalties),
            repetition_penalties=one(self.repetition_penalties),
            prompt_token_ids=one(self.prompt_token_ids),
            output_token_ids=self.output_token_ids[row : row + 1],
            logit_bias=bias,
            min_tokens={0: self.min_tokens[row]} if row in self.min_tokens else {},
            num_logprobs=self.num_logprobs[row : row + 1],
            max_num_logprobs=self.num_logprobs[row],
            allowed_token_ids=allowed,
            bad_words={0: self.bad_words[row]} if row in self.bad_words else {},
            logitsprocs=procs,
        )
