"""Speculative decoding's engine-core half: the config and the proposers that run in the engine core.

A proposer guesses each decoding request's next tokens from its tokens alone (no model); the scheduler
schedules them beside the request's last token and the worker verifies them in the same forward pass
(`tokenos.sample.rejection`). A model drafter ("draft_model", "mtp") runs in the worker; its proposer
here only hands the worker's drafts on (`draft_model.DraftModelProposer`). Pure Python, like the rest
of `tokenos.core`.
"""

from tokenos.core.spec_decode.config import WORKER_METHODS, SpeculativeConfig
from tokenos.core.spec_decode.draft_model import DraftModelProposer
from tokenos.core.spec_decode.ngram import NgramProposer
from tokenos.core.spec_decode.suffix import SuffixProposer

__all__ = ["DraftModelProposer", "NgramProposer", "SpeculativeConfig", "SuffixProposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer | DraftModelProposer:
    """The proposer `config.method` names."""
    if config.method in WORKER_METHODS:
        return DraftModelProposer(config.num_speculative_tokens)
    if config.method == "suffix":
        return SuffixProposer(
            config.num_speculative_tokens,
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
