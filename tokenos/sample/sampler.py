"""From one step's logits to one token per request.

Order (vLLM V1's): allowed token ids -> bad words -> logit bias -> min_tokens bans -> the custom
logits processors that can change the argmax -> repetition/presence/frequency penalties -> greedy rows
take the argmax; random rows go through temperature -> the argmax-invariant custom processors ->
top-k -> top-p -> min-p and are drawn by inverse-CDF sampling, from their own generator when seeded.
Logprobs, when asked for, are of the raw logits (before any of this). Every stage is skipped when no row
uses it (custom processors run whenever the engine has them: they skip their own idle work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenos.core.sched.output import TokenLogprobs
from tokenos.sample import ops
from tokenos.sample.logprobs import compute_prompt_logprobs, gather_logprobs
from tokenos.sample.metadata import SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "compute_prompt_logprobs"]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request wants none


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.shape[0] != metadata.num_reqs:
            raise ValueError(f"logits have {logits.shape[0]} rows, metadata {metadata.num_reqs}.")
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        sampled = self.sample(self.processed(logits, metadata), metadata)
        if raw_logprobs is None:
            logprobs: list[TokenLogprobs | None] = [None] * metadata.num_reqs
        else:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def processed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The logits after every stage of `process_logits`, the caller's left as they were: where nothing
        edits them and no row draws, the caller's own (at batch 64 the float32 copy of [64, 49152] logits
        was 2-3% of a decode step), else our own float32 copy put through the stages."""
        if md.all_greedy and not md.edits_logits:
            return logits
        return Sampler.process_logits(logits.to(torch.float32, copy=True), md)

    @staticmethod
    def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The stages every row goes through, greedy or not (in place, but a custom processor may return
        a new tensor: use the one returned)."""
        if md.allowed_token_ids is not None:
            ops.apply_allowed_token_ids(logits, md.allowed_token_ids)
        if md.bad_words:
            ops.apply_token_bans(logits, md.bad_words)
        if md.logit_bias is not None:
            ops.apply_logit_bias(logits, md.logit_bias)
        if md.min_tokens:
            ops.apply_token_bans(logits, md.min_tokens)
        if md.logitsprocs is not None and md.logitsprocs.non_argmax_invariant:
            logits = md.logitsprocs.apply_each(md.logitsprocs.non_argmax_invariant, logits)
        if not md.no_penalties:
            assert md.presence_penalties is not None and md.frequency_penalties is not None
            assert md.repetition_penalties is not None
            ops.apply_penalties(
                logits,
                md.prompt_token_ids,
                md.output_token_ids,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
            )
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = ops.greedy_ids(logits) if not md.all_random else None
        if md.all_greedy:
            assert greedy is not None
            return greedy
        drawn = ops.random_sample(Sampler.compute_probs(logits, md), md.generators)
        if greedy is None:
            return drawn
        return torch.where(md.greedy_mask, greedy, drawn)

    @staticmethod
    def compute_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows are drawn from ([num_reqs, vocab] float32): the processed logits
        through temperature, the argmax-invariant custom processors, top-k, top-p and min-p, softmaxed.
        Greedy rows get one too (at temperature 1), unused. Edits ``logits`` in place: take what else is
        needed of them (the argmax) first. The rejection sampler verifies drafts against the same."""
        logits.div_(md.temperature.unsqueeze(1))
        if md.logitsprocs is not None and md.logitsprocs.argmax_invariant:
            logits = md.logitsprocs.apply_each(md.logitsprocs.argmax_invariant, logits)
        if md.top_k is not None:
            ops.apply_top_k(logits, md.top_k)
        if md.top_p is not None:
            ops.apply_top_p(logits, md.top_p, md.top_k)
        if md.min_p is not None:
            ops.apply_min_p(logits, md.min_p)
        return logits.softmax(dim=1)
