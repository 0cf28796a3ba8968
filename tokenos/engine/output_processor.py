"""Frontend output processing: engine-core outputs -> user-facing `RequestOutput`s.

Per request it keeps the incremental detokenizer (which also finds stop strings), the
token ids, logprobs and timing; a stop string found here ends the request, and its id is
returned so the caller aborts it in the engine core. A parent request with n > 1 samples
gathers its children's `CompletionOutput`s by index. With metrics, each sample's timeline goes to
`EngineMetrics` as it moves and once when it ends, whether it finished or was aborted here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenos.core.messages import EngineCoreOutput, FinishReason
from tokenos.engine.detokenizer import IncrementalDetokenizer
from tokenos.engine.input_processor import ProcessedRequest
from tokenos.outputs import CompletionOutput, Logprob, RequestOutput
from tokenos.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the offline LLM never loads prometheus_client
    from tokenos.engine.metrics import SampleStats


@dataclass
class SampleState:
    """One sample (child request) of a parent request."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_tokens: int = 0
    stats: SampleStats | None = None  # with metrics only

    @property
    def text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival_time: float
    queue: object | None = None  # an asyncio.Queue for AsyncLLM; None offline
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    # Why the engine failed this request (one of its samples), if it did.
    error: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, metrics=None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SampleState]] = {}

    def add_request(self, request: ProcessedRequest, queue: object | None = None) -> None:
        """Track a request that went through the front door, one sample per engine-core request."""
        request_id, params = request.request_id, request.params
        prompt, prompt_token_ids = request.prompt.text, request.prompt.token_ids
        samples = []
        for i, cid in enumerate(request.sample_ids):
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                if params.detokenize and self.tokenizer is not None
                else None
            )
            samples.append(
                SampleState(
                    cid,
                    i,
                    detok,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        parent = ParentState(request_id, prompt, prompt_token_ids, params, samples, time.monotonic(), queue)
        if self.metrics is not None:
            for s in samples:
                s.stats = self.metrics.new_sample(
                    s.request_id, parent.arrival_time, len(prompt_token_ids), params.max_tokens
                )
        self.parents[request_id] = parent
        for s in samples:
            self.child_to_parent[s.request_id] = (parent, s)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a parent request (client gone, or an explicit abort); its unfinished samples end as
        aborts, counted in the metrics. Returns their ids for the engine core to abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        unfinished = [s for s in parent.samples if s.finish_reason is None]
        for s in parent.samples:
            self.child_to_parent.pop(s.request_id, None)
        now = time.monotonic()
        for s in unfinished:
            s.finish_reason = "abort"
            self._observe_finished(s, "abort", now)
        if unfinished:
            self._observe_parent_finished(parent)
        return [s.request_id for s in unfinished]

    def _observe_finished(self, sample: SampleState, reason: str, now: float) -> None:
        if self.metrics is not None and sample.stats is not None:
            self.metrics.observe_finished(sample.stats, reason, now)

    def _observe_parent_finished(self, parent: ParentState) -> None:
        if self.metrics is not None:
            longest = max(len(s.token_ids) for s in parent.samples)
            self.metrics.observe_parent_finished(len(parent.samples), longest)

    # ------------------------------------------------------------ the per-step update

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns (outputs ready for users, child ids to abort in the core)."""
        now = time.monotonic()
        ready: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue  # aborted by the frontend already
            parent, sample = entry
            if sample.finish_reason is not None:
                continue
            stopped_by_string = self._update_sample(parent, sample, out, now)
            if stopped_by_string:
                to_abort.append(sample.request_id)
            if sample.finish_reason is not None:
                self.child_to_parent.pop(sample.request_id, None)
                # The engine failing this sample alone is vLLM's "error" (its output still says abort).
                self._observe_finished(
                    sample, "error" if out.error is not None else sample.finish_reason, now
                )
            request_output = self._make_output(parent, sample)
            if request_output is not None:
                earlier = ready.get(parent.request_id)
                if earlier is not None and parent.params.output_kind == RequestOutputKind.DELTA:
                    # two samples of one parent moved in this step: one output carries both deltas
                    request_output.outputs = earlier.outputs + request_output.outputs
                ready[parent.request_id] = request_output
            if parent.finished:
                self.parents.pop(parent.request_id, None)
                self._observe_parent_finished(parent)
        return list(ready.values()), to_abort

    def _update_sample(
        self, parent: ParentState, sample: SampleState, out: EngineCoreOutput, now: float
    ) -> bool:
        if out.num_cached_tokens:
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        # The prompt is the parent's: its logprobs come from sample 0 (siblings fork from it, or, when the
        # fork cannot happen, compute the same prompt again).
        if out.prompt_logprobs is not None and sample.index == 0:
            parent.prompt_logprobs = (parent.prompt_logprobs or []) + [
                self._logprob_dict(lp) if lp is not None else None for lp in out.prompt_logprobs
            ]
        new_ids = list(out.new_token_ids)
        if new_ids:
            if parent.first_token_time is None:
                parent.first_token_time = now
            parent.last_token_time = now
            if self.metrics is not None and sample.stats is not None:
                self.metrics.observe_tokens(sample.stats, len(new_ids), now, out.num_cached_tokens)
            parent.num_generation_tokens += len(new_ids)
            sample.token_ids.extend(new_ids)
            if out.new_logprobs is not None and sample.logprobs is not None:
                for lp in out.new_logprobs:
                    sample.logprobs.append(self._logprob_dict(lp))
                    sample.cumulative_logprob += lp[1][0]
        stop_str = None
        if sample.detokenizer is not None:
            stop_str = sample.detokenizer.update(new_ids, out.finish_reason is not None)
        if stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            return out.finish_reason is None
        if out.finish_reason is not None:
            sample.finish_reason = str(FinishReason(out.finish_reason))
            sample.stop_reason = out.stop_reason
        if out.error is not None:
            parent.error = out.error
        return False

    def _logprob_dict(self, lp) -> dict[int, Logprob]:
        ids, logprobs, rank = lp
        result: dict[int, Logprob] = {}
        for i, (tok, value) in enumerate(zip(ids, logprobs, strict=True)):
            if tok in result:
                continue
            result[tok] = Logprob(value, rank if i == 0 else i, self._decode_token(tok))
        return result

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ building user outputs

    def _completion(self, parent: ParentState, sample: SampleState, delta: bool) -> CompletionOutput:
        text = sample.text
        token_ids, logprobs = sample.token_ids, sample.logprobs
        if delta:
            text = text[sample.sent_text_len :]
            token_ids = token_ids[sample.sent_tokens :]
            logprobs = logprobs[sample.sent_tokens :] if logprobs is not None else None
        sample.sent_text_len = len(sample.text)
        sample.sent_tokens = len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _make_output(self, parent: ParentState, sample: SampleState) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = [self._completion(parent, sample, delta=True)]
        else:
            completions = [self._completion(parent, s, delta=False) for s in parent.samples]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
            metrics={
                "arrival_time": parent.arrival_time,
                "first_token_time": parent.first_token_time,
                "num_generation_tokens": parent.num_generation_tokens,
            },
        )
