"""The scheduler: one token budget per step, spent on running requests first, then waiting ones.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` and
`num_tokens`; every step tries to close the gap for as many requests as the budget
(`max_num_batched_tokens`) and the concurrency cap (`max_num_seqs`) allow. A prompt that does not
fit is cut (chunked prefill) and continues next step, mixed with other requests' decodes.

Memory: a request is admitted only if the pool can hold its whole current need (not just the
first chunk). When a running request cannot get a block, the lowest-priority running request
is preempted by recompute (blocks freed, hashes kept, back to the front of the waiting queue)
and no new request is admitted in that step.

Recurrent groups in "align" mode: multi-token chunks that do not finish the request's known
tokens end on a multiple of `scheduler_alignment`, and one ends on the last such boundary of the
tokens, so prompts leave checkpoints where later requests can resume.

Forks (n > 1). The samples of one request share a prompt; samples 1..n-1 (`Request.fork_of` names
sample 0, the parent) are parked, outside the waiting queue, while the parent computes the prompt.
The parent's chunk stops at the fork point F = prompt length - 1; after that step has run the
siblings go to the front of the queue and, if the parent is still exactly at F, each is admitted
with a hit of F tokens on the parent's own pages (`KVCacheCoordinator.fork_hit`): full attention
pages shared by refcount, the partial page and every recurrent running state copied eagerly into
the sibling's private pages before the step writes anything. Then the parent and its siblings each
compute the last prompt token in one batch and sample independently. A recurrent state is thus
copied at the fork instead of recomputed. Whenever the fork cannot happen (the parent was
aborted, preempted or moved on, its hit already covered F, the pool is short), siblings simply
become ordinary requests, and prefix caching still shares what it can.

Per-step cost matters: the decode path does a handful of integer operations and dict stores per
request and allocates only what the output messages need.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.kv_cache.manager import KVCacheManager
from tokenos.core.kv_cache.spec import KVCacheConfig
from tokenos.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenos.core.request import Request, RequestStatus
from tokenos.core.sched.request_queue import create_request_queue

_RUNNING = RequestStatus.RUNNING
_FINISH_REASON_OF = {
    RequestStatus.FINISHED_STOPPED: int(FinishReason.STOP),
    RequestStatus.FINISHED_LENGTH: int(FinishReason.LENGTH),
    RequestStatus.FINISHED_ABORTED: int(FinishReason.ABORT),
}


def _fork_point(req: Request) -> int:
    """Where siblings fork from a parent: all of the prompt but its last token, which each sample
    computes itself (its logits are not kept)."""
    return req.num_prompt_tokens - 1


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        if (
            not scheduler_config.enable_chunked_prefill
            and scheduler_config.max_num_batched_tokens < max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) < max_model_len "
                f"({max_model_len}) with chunked prefill off: long prompts could never run. "
                "Enable chunked prefill or raise max_num_batched_tokens."
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_threshold = scheduler_config.long_prefill_token_threshold
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.policy
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.hash_algo,
            checkpoint_at_end=cache_config.mamba_checkpoint_at_end,
        )
        kv = self.kv_cache_manager
        self.alignment = kv_cache_config.scheduler_alignment if kv.enable_caching else 1
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the worker drops them next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Forks: parent id -> parked siblings; sibling id -> (parent, its preemption count) for
        # siblings released to the queue that may fork from the parent's pages.
        self.fork_waiters: dict[str, list[Request]] = {}
        self.fork_ready: dict[str, tuple[Request, int]] = {}
        self.num_parked = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt.")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens, "
                f"more than max_model_len={self.max_model_len}. Shorten the prompt."
            )
        if self.kv_cache_manager.enable_caching:
            request.set_block_hasher(self.kv_cache_manager.block_hasher)
        cap = self.max_model_len
        if request.max_tokens is not None:
            cap = min(cap, request.num_prompt_tokens + request.max_tokens)
        request.max_total_tokens = cap
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.fork_of is None or not self._park(request):
            self.waiting.add(request)

    # ------------------------------------------------------------------ forks (n > 1)

    def _park(self, req: Request) -> bool:
        """Park a sibling until its parent has computed the shared prompt (False: cannot fork)."""
        parent = self.requests.get(req.fork_of)  # type: ignore[arg-type]
        if (
            parent is None
            or parent.num_computed_tokens >= _fork_point(parent)
            or parent.cache_salt != req.cache_salt
            or parent.adapter_id != req.adapter_id
            or req.sampling_params.prompt_logprobs is not None
            or parent.prompt_token_ids != req.prompt_token_ids
        ):
            return False
        self.fork_waiters.setdefault(parent.request_id, []).append(req)
        self.num_parked += 1
        return True

    def _unpark(self, req: Request) -> bool:
        siblings = self.fork_waiters.get(req.fork_of)  # type: ignore[arg-type]
        if not siblings or req not in siblings:
            return False
        siblings.remove(req)
        self.num_parked -= 1
        return True

    def _release_forks(self, parent: Request, fork: bool) -> None:
        """Siblings to the front of the queue; with `fork`, they may fork from the parent."""
        siblings = self.fork_waiters.pop(parent.request_id, None)
        if not siblings:
            return
        self.num_parked -= len(siblings)
        for sib in reversed(siblings):
            if fork:
                self.fork_ready[sib.request_id] = (parent, parent.num_preemptions)
            self.waiting.prepend(sib)

    def _fork_hit(self, req: Request) -> tuple[tuple, int] | None:
        """(hit blocks, F) for a released sibling whose parent is still exactly at the fork point."""
        parent, preemptions = self.fork_ready.pop(req.request_id)
        point = _fork_point(parent)
        if (
            parent.status != _RUNNING
            or parent.num_preemptions != preemptions  # readmitted: its pages may be unwritten
            or parent.num_computed_tokens != point  # before this step: it is exactly at F
        ):
            return None
        return self.kv_cache_manager.fork_blocks(parent, point)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (normally: abort) requests wherever they are; all their blocks return."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a finished status, got {status!r}.")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        drop_running = False
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == _RUNNING:
                drop_running = True
            elif req.fork_of is None or not self._unpark(req):
                self.waiting.remove(req)
                self.fork_ready.pop(rid, None)
            req.status = status
            self._free_request(req)
        if drop_running:
            self.running = [r for r in self.running if r.status == _RUNNING]

    def _free_request(self, req: Request) -> None:
        if self.fork_waiters:
            self._release_forks(req, fork=False)  # an aborted parent: siblings go on alone
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_parked

    def has_unfinished_requests(self) -> bool:
        # Parked siblings imply a waiting or running parent.
        return bool(self.waiting) or bool(self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + self.num_parked,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
        }

    # ------------------------------------------------------------------ schedule

    def _chunk(self, req: Request, num_computed: int, num_new: int, budget: int) -> int:
        """Tokens to schedule: threshold, budget and alignment applied to the remaining `num_new`."""
        if 0 < self.long_prefill_threshold < num_new:
            num_new = self.long_prefill_threshold
        if num_new > budget:
            num_new = budget
        if self.alignment > 1 and num_new > 1:
            num_new = self._align(req, num_computed, num_new)
        if self.fork_waiters and req.request_id in self.fork_waiters:
            point = _fork_point(req)  # stop there: siblings copy the state after it
            if num_computed < point < num_computed + num_new:
                num_new = point - num_computed
        return num_new

    def _align(self, req: Request, num_computed: int, num_new: int) -> int:
        a = self.alignment
        end = num_computed + num_new
        last = req.num_tokens // a * a  # the last boundary of the known tokens
        if end < last:
            aligned = end // a * a
            # No boundary reachable this step (tiny budget): go unaligned rather than stall;
            # only the checkpoint opportunity is lost, correctness does not depend on it.
            return aligned - num_computed if aligned > num_computed else num_new
        if num_computed < last < end:
            return last - num_computed  # split at the last boundary so it becomes a checkpoint
        return num_new

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_scheduled_tokens
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        running_new_ids: dict[str, tuple] = {}
        running_removed: dict[str, tuple] = {}
        copies: dict[str, dict[int, tuple[int, int]]] = {}
        page_copies: dict[str, dict[int, tuple[int, int]]] = {}
        preempted: set[str] = set()
        new_reqs: list[Request] = []
        has_skipping, has_recurrent = kv.has_skipping, kv.has_recurrent
        max_model_len = self.max_model_len

        # ---- running requests first, in order (FCFS: oldest first; priority: as admitted)
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_computed_tokens
            num_new = len(req.all_token_ids) - n
            if num_new > 1 or num_new > budget:
                num_new = self._chunk(req, n, num_new, budget)
            if n + num_new > max_model_len:
                num_new = max_model_len - n
            if num_new <= 0:
                i += 1
                continue
            rid = req.request_id
            if has_skipping:
                removed = kv.remove_skipped_blocks(req)
                if removed is not None:
                    running_removed[rid] = removed
            while True:
                new_ids = kv.allocate_slots(req, num_new)
                if new_ids is not None:
                    break
                victim = self._select_victim()
                vi = running.index(victim)
                budget += self._preempt(
                    victim,
                    num_scheduled,
                    scheduled_running,
                    running_new_ids,
                    running_removed,
                    copies,
                    preempted,
                )
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            if new_ids is None:
                continue  # `req` itself was preempted; running[i] is now the next request
            if new_ids:
                running_new_ids[rid] = new_ids
            if has_recurrent:
                c = kv.state_copies(n, n + num_new)
                if c:
                    copies[rid] = c
            num_scheduled[rid] = num_new
            scheduled_running.append(req)
            budget -= num_new
            i += 1

        # ---- then waiting requests, unless this step had to preempt
        if not preempted:
            waiting = self.waiting
            max_running = self.max_num_running_reqs
            while waiting and budget > 0 and len(running) < max_running:
                req = waiting.peek()
                fork = self._fork_hit(req) if self.fork_ready and req.request_id in self.fork_ready else None
                computed_blocks, num_hit = fork if fork is not None else kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_hit
                if not self.chunked_prefill and num_new > budget:
                    break
                num_new = self._chunk(req, num_hit, num_new, budget)
                if num_new <= 0:
                    break
                new_ids = kv.allocate_slots(
                    req, num_new, num_hit, computed_blocks, num_tokens_to_reserve=req.num_tokens
                )
                if new_ids is None:
                    break  # head of line waits for memory; no skipping ahead
                waiting.pop()
                running.append(req)
                req.status = _RUNNING
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                if has_recurrent:
                    c = kv.state_copies(num_hit, num_hit + num_new)
                    if c:
                        copies[req.request_id] = c
                c = kv.take_prefix_page_copies(req)
                if c:
                    page_copies[req.request_id] = c
                num_scheduled[req.request_id] = num_new
                new_reqs.append(req)
                budget -= num_new
                if self.fork_waiters and num_hit >= _fork_point(req):
                    self._release_forks(req, fork=False)  # the hit covers the fork point already

        # ---- build the output, then advance the computed counters
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                eos_token_id=r.eos_token_id,
            )
            for r in new_reqs
        ]
        cached = CachedRequestData()
        cached.req_ids = [r.request_id for r in scheduled_running]
        cached.num_computed_tokens = [r.num_computed_tokens for r in scheduled_running]
        get = running_new_ids.get
        cached.new_block_ids = [get(rid) for rid in cached.req_ids]
        if running_removed:
            get = running_removed.get
            cached.removed_block_idx = [get(rid) for rid in cached.req_ids]
        else:
            cached.removed_block_idx = [None] * len(cached.req_ids)
        for r in scheduled_running:
            r.num_computed_tokens += num_scheduled[r.request_id]
        for r in new_reqs:
            r.num_computed_tokens += num_scheduled[r.request_id]

        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            mamba_state_copies=copies,
            prefix_page_copies=page_copies,
        )
        self.finished_req_ids = set()
        return out

    def _select_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim, num_scheduled, scheduled_running, new_ids, removed, copies, preempted) -> int:
        """Preempt `victim` by recompute; returns the budget it gives back (0 if unscheduled)."""
        rid = victim.request_id
        self.running.remove(victim)
        returned = num_scheduled.pop(rid, 0)
        if returned:
            # Scheduled earlier in this very step (priority policy): cancel that, and unpublish
            # the blocks it cached for the step, which will now never be written.
            scheduled_running.remove(victim)
            new_ids.pop(rid, None)
            removed.pop(rid, None)
            copies.pop(rid, None)
            self.kv_cache_manager.free_unfinished_step(victim)
        else:
            self.kv_cache_manager.free(victim)  # checkpoints where it stops: it may resume there
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        preempted.add(rid)
        return returned

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply the stop rules, free finished requests.

        One EngineCoreOutput per request that got new tokens, prompt logprobs, or finished.
        """
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        requests = self.requests
        kv = self.kv_cache_manager
        cache_recurrent = kv.has_recurrent_caching
        copy_sources = kv.coordinator.cow.borrowed
        fork_waiters = self.fork_waiters
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        check_stop = self._check_stop
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None or req.status != _RUNNING:
                continue  # aborted or preempted since it was scheduled
            if cache_recurrent:
                kv.cache_recurrent_blocks(req)
            if copy_sources and rid in copy_sources:
                kv.release_copy_sources(req)
            if fork_waiters and rid in fork_waiters and req.num_computed_tokens >= _fork_point(req):
                self._release_forks(req, fork=req.num_computed_tokens == _fork_point(req))
            i = index.get(rid)
            tokens = sampled[i] if i is not None else None
            finished = False
            new_lp = None
            # Tokens sampled for a partial prefill chunk are not real outputs: ignore them.
            if tokens and req.num_computed_tokens >= len(req.all_token_ids):
                for k, tok in enumerate(tokens):
                    req.append_output_token_ids(tok)
                    if check_stop(req):
                        finished = True
                        tokens = tokens[: k + 1]
                        break
                if logprobs is not None and logprobs[i] is not None:
                    new_lp = [(lp.token_ids, lp.logprobs, lp.rank) for lp in logprobs[i][: len(tokens)]]
            else:
                tokens = None
            plp = prompt_logprobs.get(rid) if prompt_logprobs else None
            if tokens or finished or plp is not None:
                if plp is not None:
                    plp = [None if lp is None else (lp.token_ids, lp.logprobs, lp.rank) for lp in plp]
                # Positional: request_id, new_token_ids, new_logprobs, prompt_logprobs,
                # finish_reason, stop_reason, num_cached_tokens (the hot path of every step).
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        tokens or [],
                        new_lp,
                        plp,
                        _FINISH_REASON_OF[req.status] if finished else None,
                        req.stop_reason,
                        req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                    )
                )
            if finished:
                any_finished = True
                self._free_request(req)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return outputs

    def _check_stop(self, req: Request) -> bool:
        """Stop rules, after one token was appended. Sets status (and stop_reason)."""
        sp = req.sampling_params
        out = req.output_token_ids
        if len(out) >= sp.min_tokens:
            last = out[-1]
            if last == req.eos_token_id and not sp.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.all_stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        # max_total_tokens = min(max_model_len, prompt + max_tokens), set in add_request.
        if len(req.all_token_ids) >= req.max_total_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
