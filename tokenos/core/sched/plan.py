"""`StepPlan`: what one `schedule()` call has decided so far, and the `SchedulerOutput` it becomes.

The scheduler fills a plan request by request (running requests, then admissions) while it spends the
step's token budget; a request preempted after it was scheduled in the same step is taken out again
(`cancel`). `to_output` then writes the worker's messages and advances every scheduled request's
``num_computed_tokens`` by its tokens (the counts in the messages are the counts BEFORE the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenos.core.request import Request
from tokenos.core.sched.output import BlockIds, CachedRequestData, NewRequestData, SchedulerOutput

# group id -> (src, dst): see SchedulerOutput.mamba_state_copies / prefix_page_copies.
PageCopies = dict[int, tuple[int, int]]


@dataclass
class StepPlan:
    budget: int  # tokens left to spend this step
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)  # scheduled running requests, in order
    admitted: list[Request] = field(default_factory=list)  # requests admitted this step
    new_block_ids: dict[str, BlockIds] = field(default_factory=dict)
    removed_block_idx: dict[str, BlockIds] = field(default_factory=dict)
    state_copies: dict[str, PageCopies] = field(default_factory=dict)
    page_copies: dict[str, PageCopies] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled, per request

    def schedule_running(
        self,
        request: Request,
        num_tokens: int,
        new_block_ids: BlockIds | None,
        removed: BlockIds | None,
        copies: PageCopies | None,
        spec_tokens: list[int] | None = None,
    ) -> None:
        rid = request.request_id
        if spec_tokens:
            self.spec_tokens[rid] = spec_tokens
        if new_block_ids:
            self.new_block_ids[rid] = new_block_ids
        if removed is not None:
            self.removed_block_idx[rid] = removed
        if copies:
            self.state_copies[rid] = copies
        self.num_scheduled[rid] = num_tokens
        self.running.append(request)
        self.budget -= num_tokens

    def admit(
        self, request: Request, num_tokens: int, copies: PageCopies | None, page_copies: PageCopies | None
    ) -> None:
        rid = request.request_id
        if copies:
            self.state_copies[rid] = copies
        if page_copies:
            self.page_copies[rid] = page_copies
        self.num_scheduled[rid] = num_tokens
        self.admitted.append(request)
        self.budget -= num_tokens

    def cancel(self, request: Request) -> int:
        """Take a running request back out of the plan (preempted in this same step); returns the
        tokens it gives back to the budget (0 if it was not scheduled)."""
        rid = request.request_id
        returned = self.num_scheduled.pop(rid, 0)
        if returned:
            self.running.remove(request)
            self.new_block_ids.pop(rid, None)
            self.removed_block_idx.pop(rid, None)
            self.state_copies.pop(rid, None)
            self.spec_tokens.pop(rid, None)
            self.budget += returned
        return returned

    def to_output(self, block_ids_of, finished_req_ids: set[str], total_budget: int) -> SchedulerOutput:
        """The worker's messages for this plan; advances the scheduled requests' computed counters.
        ``block_ids_of(request_id)`` gives a new request's block lists."""
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=block_ids_of(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                eos_token_id=r.eos_token_id,
                stop_token_ids=sorted(r.stop_token_ids),
                adapter_id=r.adapter_id,
            )
            for r in self.admitted
        ]
        cached = CachedRequestData()
        cached.req_ids = [r.request_id for r in self.running]
        cached.num_computed_tokens = [r.num_computed_tokens for r in self.running]
        cached.new_block_ids = [self.new_block_ids.get(rid) for rid in cached.req_ids]
        if self.removed_block_idx:
            cached.removed_block_idx = [self.removed_block_idx.get(rid) for rid in cached.req_ids]
        else:
            cached.removed_block_idx = [None] * len(cached.req_ids)
        num_scheduled = self.num_scheduled
        for r in self.running:
            r.num_computed_tokens += num_scheduled[r.request_id]
        for r in self.admitted:
            r.num_computed_tokens += num_scheduled[r.request_id]
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total_budget - self.budget,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted,
            mamba_state_copies=self.state_copies,
            prefix_page_copies=self.page_copies,
            scheduled_spec_decode_tokens=self.spec_tokens,
        )
