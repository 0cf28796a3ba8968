"""The engine core's face of a model drafter (method "draft_model"): it proposes nothing itself.

The drafter runs in the worker beside the target (`tokenos.worker.draft_model`); after each step the
worker returns each decoding request's drafts in `ModelRunnerOutput.draft_token_ids`, and this proposer
hands them out through the same `propose(request, max_tokens)` call the token-only proposers answer, so
the scheduler applies the same limits (max_tokens / max_model_len room, grammar prefix,
`disable_by_batch_size`) to every method. The worker keeps the drafter's probabilities of those drafts;
the scheduler only ever cuts drafts from the end, so each kept draft still has its q there.
"""

from __future__ import annotations

from tokenos.core.spec_decode.ngram import Proposable


class DraftModelProposer:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self._drafts: dict[str, list[int]] = {}

    def take(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The worker's drafts of the step just run; drafts of earlier steps are stale (their tokens have
        moved on) and are dropped."""
        self._drafts = draft_token_ids

    def propose(self, request: Proposable, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        return self._drafts.get(request.request_id, [])[: min(self.k, max_tokens)]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
