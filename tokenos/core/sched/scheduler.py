"""The scheduler: one token budget per step, spent on running requests first, then waiting ones.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` and
`num_tokens`; every step tries to close the gap for as many requests as the budget
(`max_num_batched_tokens`) and the concurrency cap (`max_num_seqs`) allow. A prompt that does not
fit is cut (chunked prefill, `chunking.ChunkPolicy`) and continues next step, mixed with other
requests' decodes.

Memory: a request is admitted only if the pool can hold its whole current need (not just the
first chunk). When a running request cannot get a block, the lowest-priority running request
is preempted by recompute (blocks freed, hashes kept, back to the front of the waiting queue)
and no new request is admitted in that step.

`schedule()` is three moves over one `StepPlan`: schedule the running requests, admit waiting ones
(unless this step preempted), build the output. n > 1 samples fork from their first sample's pages
(`forks.ForkTracker`). The scheduler talks to memory only through `KVCacheManager`'s public methods.

Per-step cost matters: the decode path does a handful of integer operations and dict stores per
request and allocates only what the output messages need.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.kv_cache.manager import KVCacheManager
from tokenos.core.kv_cache.spec import KVCacheConfig, MambaSpec
from tokenos.core.messages import EngineCoreOutput, FinishReason
from tokenos.core.request import Request, RequestStatus
from tokenos.core.sched.chunking import ChunkPolicy
from tokenos.core.sched.forks import ForkTracker
from tokenos.core.sched.output import ModelRunnerOutput, SchedulerOutput
from tokenos.core.sched.plan import StepPlan
from tokenos.core.sched.request_queue import create_request_queue
from tokenos.core.spec_decode import DraftModelProposer, SpeculativeConfig, make_proposer

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        """``max_loras``: the most distinct LoRA adapters (`Request.adapter_id`) in the running set,
        hence in one step (None: no adapters are served)."""
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
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.policy
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.hash_algo,
            checkpoint_at_end=cache_config.mamba_checkpoint_at_end,
            hit_needs_next_token=speculative_config is not None and speculative_config.kv_reads_next_token,
        )
        kv = self.kv_cache_manager
        alignment = kv_cache_config.scheduler_alignment if kv.enable_caching else 1
        self.chunking = ChunkPolicy(scheduler_config.long_prefill_token_threshold, alignment)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.forks = ForkTracker(self.requests, self.waiting)
        # Finished or aborted since the last schedule(): the worker drops them next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # For the frontend's metrics: steps so far, and the last step's tokens and first admissions
        # (request id -> time.monotonic() when it was first scheduled: its queue time ends there).
        self.num_steps = 0
        self.last_step_tokens = 0
        self.last_step_first_scheduled: dict[str, float] = {}
        # Speculative decoding: the proposer (None: off) and the cumulative acceptance counters.
        self.max_drafts = _max_drafts(kv_cache_config, speculative_config) if speculative_config else 0
        self.spec = speculative_config
        self.proposer = make_proposer(speculative_config) if speculative_config is not None else None
        # A model drafter writes its K/V at positions after a request's last token while it proposes
        # (before the next step schedules them): slots the allocation reserves ahead, publishing nothing.
        self.num_lookahead = speculative_config.lookahead_slots if speculative_config is not None else 0
        self.spec_stats = SpecStats(speculative_config.num_speculative_tokens if speculative_config else 0)
        self.max_loras = max_loras
        # Called with every request the scheduler lets go (finished, aborted): the engine releases its
        # adapter.
        self.on_request_freed: Callable[[Request], None] | None = None

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
        if request.fork_of is None or not self.forks.park(request):
            self.waiting.add(request)

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
            elif not self.forks.unpark(req):
                self.waiting.remove(req)
                self.forks.forget(rid)
            req.status = status
            self._free_request(req)
        if drop_running:
            self.running = [r for r in self.running if r.status == _RUNNING]

    def _free_request(
        self, req: Request, failed_step_start: int | None = None, publish_end: bool = True
    ) -> None:
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        if self.forks.waiters:
            self.forks.release(req, fork=False)  # an aborted parent: siblings go on alone
        if failed_step_start is None:
            self.kv_cache_manager.free(req, publish_end)
        else:
            self.kv_cache_manager.free_failed_step(req, failed_step_start)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)
        if self.on_request_freed is not None:
            self.on_request_freed(req)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + self.forks.num_parked

    def has_unfinished_requests(self) -> bool:
        # Parked siblings imply a waiting or running parent.
        return bool(self.waiting) or bool(self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> dict:
        stats = self._base_stats()
        if self.max_loras is not None:
            stats["lora"] = {
                "max_lora": self.max_loras,
                "running": _adapter_names(self.running),
                "waiting": _adapter_names(self.waiting),
            }
        return stats

    def _base_stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + self.forks.num_parked,
            # Of those, n > 1 siblings parked until sample 0 reaches the fork point (not capacity).
            "num_waiting_deferred": self.forks.num_parked,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hits_by_source": dict(kv.hits_by_source),
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "step_tokens": self.last_step_tokens,
            "first_scheduled": self.last_step_first_scheduled,
            **({"spec_decoding": self.spec_stats.as_dict()} if self.proposer is not None else {}),
        }

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.max_num_scheduled_tokens)
        if self.last_step_first_scheduled:  # a new dict, never cleared: stats already made keep theirs
            self.last_step_first_scheduled = {}
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        out = plan.to_output(
            self.kv_cache_manager.get_block_ids, self.finished_req_ids, self.max_num_scheduled_tokens
        )
        self.finished_req_ids = set()
        self.num_steps += 1
        self.last_step_tokens = out.total_num_scheduled_tokens
        return out

    def _num_new_tokens(self, req: Request, num_computed: int, num_new: int, budget: int) -> int:
        if num_new > 1 or num_new > budget:
            num_new = self.chunking.num_tokens(req, num_computed, num_new, budget, self.forks.stop_point(req))
        if num_computed + num_new > self.max_model_len:
            num_new = self.max_model_len - num_computed
        return num_new

    def _lookahead(self, num_tokens: int) -> int:
        """Slots to reserve past a request's first ``num_tokens`` for its drafter (0 without one)."""
        return min(self.num_lookahead, self.max_model_len - num_tokens) if self.num_lookahead else 0

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests first, in order (FCFS: oldest first; priority: as admitted), preempting
        from the back (or by priority) when the pool runs dry."""
        kv = self.kv_cache_manager
        has_skipping, has_recurrent = kv.has_skipping, kv.has_recurrent
        running = self.running
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            n = req.num_computed_tokens
            drafts = req.spec_token_ids
            num_new = self._num_new_tokens(req, n, req.num_tokens_with_spec - n, plan.budget)
            if num_new <= 0:
                i += 1
                continue
            if drafts:  # the budget or max_model_len cuts drafts first; they are proposed anew next step
                drafts = drafts[: max(n + num_new - len(req.all_token_ids), 0)]
                req.spec_token_ids = []
            removed = kv.remove_skipped_blocks(req) if has_skipping else None
            while True:
                look = self._lookahead(n + num_new)
                alloc = kv.allocate_slots(
                    req, num_new, num_draft_tokens=len(drafts), num_lookahead_tokens=look
                )
                if alloc.ok:
                    break
                victim = self._select_victim()
                if running.index(victim) < i:
                    i -= 1
                self._preempt(victim, plan)
                if victim is req:
                    break
            if not alloc.ok:
                continue  # `req` itself was preempted; running[i] is now the next request
            copies = kv.state_copies(n, n + num_new) if has_recurrent else None
            plan.schedule_running(req, num_new, alloc.new_block_ids, removed, copies, drafts)
            i += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit from the head of the queue while budget, seats, memory and adapter slots last (no
        skipping ahead: a request whose adapter finds every slot taken waits, and so do those behind it,
        until a running adapter's requests finish; nobody starves)."""
        kv = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        adapters = self._running_adapters() if self.max_loras is not None else None
        while waiting and plan.budget > 0 and len(running) < self.max_num_running_reqs:
            req = waiting.peek()
            if adapters is not None and not self._adapter_fits(req, adapters):
                break
            hit = self.forks.take_hit(req, kv) or kv.get_computed_blocks(req)
            num_hit = hit.num_tokens
            num_new = req.num_tokens - num_hit
            if not self.chunked_prefill and num_new > plan.budget:
                break
            num_new = self.chunking.num_tokens(req, num_hit, num_new, plan.budget, self.forks.stop_point(req))
            if num_new <= 0:
                break
            look = self._lookahead(num_hit + num_new) if num_hit + num_new == req.num_tokens else 0
            alloc = kv.allocate_slots(
                req, num_new, hit, num_tokens_to_reserve=req.num_tokens, num_lookahead_tokens=look
            )
            if not alloc.ok:
                break  # head of line waits for memory
            waiting.pop()
            running.append(req)
            req.status = _RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # its first admission (not a resumption after preemption)
                req.num_cached_tokens = num_hit
                self.last_step_first_scheduled[req.request_id] = time.monotonic()
            if adapters is not None and req.adapter_id is not None:
                adapters.add(req.adapter_id)
            copies = kv.state_copies(num_hit, num_hit + num_new) if kv.has_recurrent else None
            plan.admit(req, num_new, copies, kv.take_prefix_page_copies(req))
            self.forks.after_admission(req, num_hit)

    def _running_adapters(self) -> set[int | str]:
        return {r.adapter_id for r in self.running if r.adapter_id is not None}

    def _adapter_fits(self, req: Request, adapters: set[int | str]) -> bool:
        return req.adapter_id is None or req.adapter_id in adapters or len(adapters) < self.max_loras

    def _select_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Preempt `victim` by recompute; if it was scheduled earlier in this step (priority policy),
        that is cancelled and the blocks it cached for the step unpublished (they will never be written)."""
        self.running.remove(victim)
        if plan.cancel(victim):
            self.kv_cache_manager.free_unfinished_step(victim)
        else:
            self.kv_cache_manager.free(victim)  # checkpoints where it stops: it may resume there
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        plan.preempted.add(victim.request_id)

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
        failed = model_runner_output.failed
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        after_step = self.kv_cache_manager.after_step
        forks = self.forks
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        check_stop = self._check_stop
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None or req.status != _RUNNING:
                continue  # aborted or preempted since it was scheduled
            i = index.get(rid)
            tokens = sampled[i] if i is not None else None
            num_scheduled = scheduler_output.num_scheduled_tokens[rid]
            if spec_tokens and rid in spec_tokens:
                # Drafts the worker rejected were computed but are not the request's: take them back
                # BEFORE anything is published (after_step), so no recurrent checkpoint inside them is.
                num_scheduled -= self._take_back_rejected(req, len(spec_tokens[rid]), tokens)
            if failed and rid in failed:
                after_step(req)
                if forks.waiters:
                    forks.after_step(req)
                outputs.append(self._fail(req, failed[rid], num_scheduled))
                any_finished = True
                continue
            num_kept = len(tokens) if tokens else 0
            finished = False
            new_lp = None
            # Tokens sampled for a partial prefill chunk are not real outputs: ignore them.
            error = None
            if tokens and req.num_computed_tokens >= len(req.all_token_ids):
                for k, tok in enumerate(tokens):
                    req.append_output_token_ids(tok)
                    if req.grammar is not None:
                        error = self._advance_grammar(req, tok)
                    if req.status != _RUNNING or check_stop(req):
                        finished = True
                        tokens = tokens[: k + 1]
                        break
                if logprobs is not None and logprobs[i] is not None:
                    new_lp = [(lp.token_ids, lp.logprobs, lp.rank) for lp in logprobs[i][: len(tokens)]]
            else:
                tokens = None
            # Recurrent checkpoints are published once the step's tokens are appended (their hashes
            # name them). A stop inside a verified run keeps fewer tokens than the worker's state
            # summarizes: count only those, and publish no recurrent state of this step.
            exact = not (finished and tokens and len(tokens) < num_kept)
            if not exact:
                req.num_computed_tokens -= num_kept - len(tokens)
            after_step(req, publish=exact)
            if forks.waiters:
                forks.after_step(req)
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
                        int(RequestStatus.finish_reason(req.status)) if finished else None,
                        req.stop_reason,
                        req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                        error,
                    )
                )
            if finished:
                any_finished = True
                self._free_request(req, publish_end=exact)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if self.proposer is not None:
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.take(model_runner_output.draft_token_ids or {})
            self._propose_drafts()
        return outputs

    def _take_back_rejected(self, req: Request, num_drafts: int, tokens: list[int] | None) -> int:
        """Take the rejected drafts of a verify step out of ``num_computed_tokens``; returns how many.
        Nothing kept (the request failed) takes back the whole step but its start."""
        kept = len(tokens) if tokens else 0
        taken = num_drafts + 1 - kept
        req.num_computed_tokens -= taken
        if tokens:
            self.spec_stats.record(num_drafts, kept - 1)
        return taken

    def _propose_drafts(self) -> None:
        """Drafts for every decoding request, for the next step; none while the batch is so large that
        verifying them costs more than it saves (`SpeculativeConfig.disable_by_batch_size`)."""
        running = self.running
        if len(running) > self.spec.disable_by_batch_size:
            for req in running:
                req.spec_token_ids = []
            return
        propose = self.proposer.propose
        for req in running:
            tokens = req.all_token_ids
            # Only a request whose every known token but the last is computed is decoding.
            if req.num_computed_tokens != len(tokens) - 1:
                req.spec_token_ids = []
                continue
            # Room for the drafts and the one token after them within max_tokens and max_model_len.
            drafts = propose(req, min(req.max_total_tokens - len(tokens) - 1, self.max_drafts))
            if drafts and req.grammar is not None:
                drafts = self._grammar_drafts(req.grammar, drafts)
            req.spec_token_ids = drafts

    @staticmethod
    def _grammar_drafts(grammar, drafts: list[int]) -> list[int]:
        """The drafts' prefix the grammar accepts (checked without advancing it): a later draft could
        only be rejected. None where the grammar cannot roll drafts back (a reasoning gate still in the
        thinking), since the step's masks advance it through them and back (structured/manager.py)."""
        if not getattr(grammar, "takes_drafts", True):
            return []
        return drafts[: grammar.validate(drafts)]

    def _fail(self, req: Request, error: str, num_scheduled: int) -> EngineCoreOutput:
        """End a request the worker failed alone; the pages its last step wrote are not trusted."""
        req.status = RequestStatus.FINISHED_ABORTED
        self._free_request(req, failed_step_start=req.num_computed_tokens - num_scheduled)
        return EngineCoreOutput(req.request_id, [], finish_reason=int(FinishReason.ABORT), error=error)

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> str | None:
        """Advance the request's grammar by its new token: stopped when the grammar is complete,
        aborted (with the error returned) when the grammar refuses a token the mask should have ruled out."""
        if not req.grammar.accept(token):
            req.status = RequestStatus.FINISHED_ABORTED
            return f"structured output: the grammar rejected token {token}"
        if req.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, req: Request) -> bool:
        """Stop rules, after one token was appended. Sets status (and stop_reason)."""
        sp = req.sampling_params
        out = req.output_token_ids
        if len(out) >= sp.min_tokens:
            last = out[-1]
            if last == req.eos_token_id and not sp.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in req.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        # max_total_tokens = min(max_model_len, prompt + max_tokens), set in add_request.
        if len(req.all_token_ids) >= req.max_total_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


class SpecStats:
    """Speculative decoding's cumulative counters, as vLLM counts them: drafts (steps of a request that
    verified some), draft tokens, accepted tokens, and accepted tokens by draft position."""

    def __init__(self, num_positions: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_positions

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
        }


def _max_drafts(config: KVCacheConfig, spec: SpeculativeConfig) -> int:
    """Drafts one verify step may carry. An "align"-mode recurrent group keeps pages only in the previous
    and the running column, so the state after an accepted prefix has a page only if a verify step (the
    last token + the drafts) crosses at most one checkpoint boundary: at most block_size - 1 drafts."""
    cap = spec.num_speculative_tokens
    for group in config.kv_cache_groups:
        s = group.kv_cache_spec
        if isinstance(s, MambaSpec) and s.cache_mode == "align":
            cap = min(cap, s.block_size - 1)
    if cap < 1:
        raise ValueError(
            "speculative decoding on this hybrid model: a recurrent checkpoint interval of 1 token in "
            "mamba_cache_mode 'align' leaves no room for drafts. Use a larger mamba_checkpoint_interval "
            "or mamba_cache_mode 'all' or 'none'."
        )
    return cap


def _adapter_names(requests: Iterable[Request]) -> list[str]:
    """The LoRA adapters' names among ``requests``, sorted."""
    return sorted({r.lora_name for r in requests if r.lora_name is not None})
