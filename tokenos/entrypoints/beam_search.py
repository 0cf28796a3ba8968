"""Beam search for the offline `LLM`, as vLLM's `LLM.beam_search` does it: on top of the engine, not in it.

Each step asks the engine for one token of every live beam with its top ``2 * beam_width`` logprobs (a
beam is just a prompt: the original tokens plus the beam's, so prefix caching makes the step cost one
token of compute per beam), extends every beam by each candidate, and keeps the ``beam_width`` best by
cumulative logprob. Every candidate ending in EOS is a finished beam (unless ``ignore_eos``). At the end
the finished and live beams are ranked by the length-penalized score ``cum_logprob / len ** length_penalty``
(len counts the prompt and the generated tokens but not an EOS, as vLLM's `get_beam_search_score` does)
and the best ``beam_width`` returned, best first; the EOS is dropped unless ``include_stop_str_in_output``.

`beam_search` takes the step as a function (token lists in, per list a dict token -> logprob out), so the
search itself is tested against hand-made distributions without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; beams are ranked by the model's logprobs either way
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's and the generated ones, as vLLM returns them
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


Step = Callable[[list[list[int]], int], list[dict[int, float]]]


def beam_score(beam: BeamSearchSequence, length_penalty: float, eos_token_id: int | None) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the length (an EOS not counted)."""
    length = len(beam.tokens) - (1 if beam.finish_reason == "stop" and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length**length_penalty)


def beam_search(
    prompts: list[list[int]], params: BeamSearchParams, step: Step, eos_token_id: int | None
) -> list[list[BeamSearchSequence]]:
    """The best ``beam_width`` sequences of each prompt, best first. ``step(token_lists, k)`` returns, per
    token list, the top-k next tokens with their logprobs."""
    width = params.beam_width
    live = [[BeamSearchSequence(list(p), num_prompt_tokens=len(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        candidates_of = step([beam.tokens for _, beam in flat], 2 * width)
        grown: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), candidates in zip(flat, candidates_of, strict=True):
            for token, logprob in candidates.items():
                grown[i].append(_extend(beam, token, logprob))
        for i, beams in enumerate(grown):
            # Every candidate ending in EOS is a finished beam; the best others live on.
            ending = [b for b in beams if not params.ignore_eos and b.tokens[-1] == eos_token_id]
            for beam in ending:
                beam.finish_reason = "stop"
            done[i].extend(ending)
            going = [b for b in beams if b.finish_reason is None]
            live[i] = sorted(going, key=lambda b: b.cum_logprob, reverse=True)[:width]
    results = []
    for i in range(len(prompts)):
        for beam in live[i]:
            beam.finish_reason = "length"
        score = lambda b: beam_score(b, params.length_penalty, eos_token_id)  # noqa: E731
        ranked = sorted(done[i] + live[i], key=score, reverse=True)[:width]
        if not params.include_stop_str_in_output:
            for beam in ranked:
                if beam.finish_reason == "stop":
                    beam.tokens = beam.tokens[:-1]
        results.append(ranked)
    return results


def _extend(beam: BeamSearchSequence, token: int, logprob: float) -> BeamSearchSequence:
    return BeamSearchSequence(
        tokens=[*beam.tokens, token],
        logprobs=[*beam.logprobs, logprob],
        cum_logprob=beam.cum_logprob + logprob,
        num_prompt_tokens=beam.num_prompt_tokens,
    )
