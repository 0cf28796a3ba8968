"""Forks (n > 1): the samples of one request compute their shared prompt once.

Samples 1..n-1 (`Request.fork_of` names sample 0, the parent) are parked, outside the waiting queue,
while the parent computes the prompt. The parent's chunk stops at the fork point F = prompt length - 1
(`stop_point`); after the step that reaches F has run, the siblings go to the front of the queue and,
if the parent is still exactly at F, each is admitted with a hit of F tokens on the parent's own pages
(`KVCacheManager.fork_hit`): full attention pages shared by refcount, the partial page and every
recurrent running state copied eagerly into the sibling's private pages before the step writes
anything. Then the parent and its siblings each compute the last prompt token in one batch and sample
independently. A recurrent state is thus copied at the fork instead of recomputed.

Whenever the fork cannot happen (the parent was aborted, preempted or moved on, its hit already covered
F, the pool is short), siblings simply become ordinary requests, and prefix caching still shares what
it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenos.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenos.core.kv_cache.cow import CacheHit
    from tokenos.core.kv_cache.manager import KVCacheManager
    from tokenos.core.sched.request_queue import RequestQueue


def fork_point(request: Request) -> int:
    """Where siblings fork from a parent: all of the prompt but its last token, which each sample
    computes itself (its logits are not kept)."""
    return request.num_prompt_tokens - 1


class ForkTracker:
    def __init__(self, requests: dict[str, Request], waiting: RequestQueue) -> None:
        self.requests = requests  # the scheduler's: id -> live request
        self.waiting = waiting
        # parent id -> parked siblings; sibling id -> (parent, its preemption count) for siblings
        # released to the queue that may fork from the parent's pages.
        self.waiters: dict[str, list[Request]] = {}
        self.ready: dict[str, tuple[Request, int]] = {}
        self.num_parked = 0

    def park(self, request: Request) -> bool:
        """Park a sibling until its parent has computed the shared prompt (False: it cannot fork)."""
        parent = self.requests.get(request.fork_of)  # type: ignore[arg-type]
        if (
            parent is None
            or parent.num_computed_tokens >= fork_point(parent)
            or parent.cache_salt != request.cache_salt
            or parent.adapter_id != request.adapter_id
            or request.sampling_params.prompt_logprobs is not None
            or parent.prompt_token_ids != request.prompt_token_ids
        ):
            return False
        self.waiters.setdefault(parent.request_id, []).append(request)
        self.num_parked += 1
        return True

    def unpark(self, request: Request) -> bool:
        """Take a parked sibling out (it is being aborted); False if it was not parked."""
        if request.fork_of is None:
            return False
        siblings = self.waiters.get(request.fork_of)
        if not siblings or request not in siblings:
            return False
        siblings.remove(request)
        self.num_parked -= 1
        return True

    def forget(self, request_id: str) -> None:
        self.ready.pop(request_id, None)

    def release(self, parent: Request, fork: bool) -> None:
        """Siblings to the front of the queue; with `fork`, they may fork from the parent."""
        siblings = self.waiters.pop(parent.request_id, None)
        if not siblings:
            return
        self.num_parked -= len(siblings)
        for sib in reversed(siblings):
            if fork:
                self.ready[sib.request_id] = (parent, parent.num_preemptions)
            self.waiting.prepend(sib)

    def stop_point(self, request: Request) -> int | None:
        """The fork point if `request` has parked siblings (its chunk must end there), else None."""
        if self.waiters and request.request_id in self.waiters:
            return fork_point(request)
        return None

    def take_hit(self, request: Request, kv: KVCacheManager) -> CacheHit | None:
        """The hit of a released sibling whose parent is still exactly at the fork point (tried once)."""
        if not self.ready or request.request_id not in self.ready:
            return None
        parent, preemptions = self.ready.pop(request.request_id)
        point = fork_point(parent)
        if (
            parent.status != RequestStatus.RUNNING
            or parent.num_preemptions != preemptions  # readmitted: its pages may be unwritten
            or parent.num_computed_tokens != point  # before this step: it is exactly at F
        ):
            return None
        return kv.fork_hit(parent, point)

    def after_admission(self, request: Request, num_hit: int) -> None:
        """A request was admitted with `num_hit` cached tokens: a hit past its fork point leaves its
        siblings nothing to fork, so they go on alone."""
        if self.waiters and num_hit >= fork_point(request):
            self.release(request, fork=False)

    def after_step(self, request: Request) -> None:
        """A step of `request` ran: once it reached the fork point its siblings go (forking only if it
        is exactly there)."""
        if request.request_id in self.waiters and request.num_computed_tokens >= fork_point(request):
            self.release(request, fork=request.num_computed_tokens == fork_point(request))
