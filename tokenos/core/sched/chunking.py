"""How many of a request's remaining tokens one step takes: chunked prefill's rules in one place.

A request with ``num_new`` tokens left gets, in order: at most ``long_prefill_token_threshold`` (so long
prompts cannot starve decodes), at most what is left of the step's budget, then two cuts that place
chunk ENDS where later requests can resume:
- alignment (recurrent groups in "align" mode): a multi-token chunk that does not finish the request's
  known tokens ends on a multiple of ``alignment``, and one ends on the last such boundary, so prompts
  leave recurrent checkpoints on block boundaries;
- a stop point (an n > 1 parent's fork point): the chunk ends there, so its siblings can copy the state
  after exactly that many tokens.
"""

from __future__ import annotations

from tokenos.core.request import Request


class ChunkPolicy:
    def __init__(self, long_prefill_token_threshold: int, alignment: int) -> None:
        self.threshold = long_prefill_token_threshold
        self.alignment = alignment

    def num_tokens(
        self, request: Request, num_computed: int, num_new: int, budget: int, stop_at: int | None = None
    ) -> int:
        """Tokens to schedule: threshold, budget, alignment and ``stop_at`` applied to ``num_new``."""
        if 0 < self.threshold < num_new:
            num_new = self.threshold
        if num_new > budget:
            num_new = budget
        if self.alignment > 1 and num_new > 1:
            num_new = self._align(request, num_computed, num_new)
        if stop_at is not None and num_computed < stop_at < num_computed + num_new:
            num_new = stop_at - num_computed
        return num_new

    def _align(self, request: Request, num_computed: int, num_new: int) -> int:
        a = self.alignment
        end = num_computed + num_new
        last = request.num_tokens // a * a  # the last boundary of the known tokens
        if end < last:
            aligned = end // a * a
            # No boundary reachable this step (tiny budget): go unaligned rather than stall;
            # only the checkpoint opportunity is lost, correctness does not depend on it.
            return aligned - num_computed if aligned > num_computed else num_new
        if num_computed < last < end:
            return last - num_computed  # split at the last boundary so it becomes a checkpoint
        return num_new
