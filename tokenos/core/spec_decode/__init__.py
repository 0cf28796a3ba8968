"""Speculative decoding's token-only half: the config and the proposers that run in the engine core.

A proposer guesses each decoding request's next tokens from its tokens alone (no model); the scheduler
schedules them beside the request's last token and the worker verifies them in the same forward pass
(`tokenos.sample.rejection`). Pure Python, like the rest of `tokenos.core`.
"""

from tokenos.core.spec_decode.config import SpeculativeConfig
from tokenos.core.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig", "make_proposer"]


def make_proposer(config: SpeculativeConfig) -> NgramProposer:
    """The proposer `config.method` names."""
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
