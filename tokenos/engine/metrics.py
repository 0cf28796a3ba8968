"""Prometheus metrics under vLLM V1's names, so a dashboard or alert written for vLLM reads tokenos.

Every series vLLM's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) exports that means something on
this engine is here under the same name, type, labels (`model_name`: the served model name; `engine`:
"0", tokenos runs one engine core per server) and buckets, with the same meaning. What is tokenos's own
is under `tokenos:`.

Two sources feed one registry of our own (never the global one, so two engines in one process or one
test session do not collide):
- the frontend's output processing, per sample (a child request: vLLM counts each of n samples as a
  request): `new_sample` when it starts, `observe_tokens` as tokens arrive (TTFT, inter-token latency,
  token counters), `observe_finished` when it ends for any reason (aborts too), and
  `observe_parent_finished` once per user request (n, the longest sample);
- the engine core's per-step stats dict, in `update_from_engine_stats`: gauges are set; the core's
  counters are cumulative, so the increase since the last dict is added to ours; each step's token count
  and the requests it scheduled for the first time (their queue time ends there) are read once per step.

Timestamps are `time.monotonic()`, one clock for both processes (CLOCK_MONOTONIC is system-wide), so a
sample's intervals add up: e2e (arrival -> its end) = queue (arrival -> first scheduled) + inference
(first scheduled -> last token) when it ends with its last token, and inference = prefill (-> first
token) + decode (first -> last token). Arrival is when the frontend hands it to the engine (tokenized).

vLLM metrics left out, and why:
- `vllm:external_prefix_cache_queries` / `_hits`, the KV-connector and KV-offload series: no KV connector
  (no cross-instance or CPU-offloaded KV); `vllm:prompt_tokens_by_source{source="external_kv_transfer"}`
  is exported and stays 0, so the sources still add up to `vllm:prompt_tokens`.
- `vllm:mm_cache_queries` / `_hits`: no multimodal inputs.
- `vllm:corrupted_requests`: vLLM counts NaN logits only with VLLM_COMPUTE_NANS_IN_LOGITS; tokenos does
  not scan logits for NaNs.
- `vllm:engine_sleep_state`: sleep mode (offloading weights between RL rollouts) is not built.
- `vllm:kv_block_lifetime_seconds`, `_idle_before_evict_seconds`, `_reuse_gap_seconds`: opt-in in vLLM
  (--kv-cache-metrics), and tokenos's block pool does not sample block residency.
- vLLM's MFU / FLOPs estimates and CUDA-graph series: GPU-only.
- `finished_reason="repetition"`: repetition detection is not built (stop, length, abort and error are).
- V0-only series (`vllm:num_requests_swapped`, `vllm:cpu_cache_usage_perc`, the `*_hit_rate` gauges):
  vLLM V1 dropped them; tokenos preempts by recompute, never swaps.
Deprecated names older vLLM dashboards still query are kept as aliases fed by the same observations:
`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_queries` / `_hits` and
`vllm:time_per_output_token_seconds` (the inter-token latency under its pre-0.11 name).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENGINE_INDEX = "0"  # one engine core per server (vLLM: one label value per data-parallel engine)
LABELS = ("model_name", "engine")

# vLLM's buckets, exactly: fleets that mix vLLM and tokenos can `sum by (le)` across them.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# Token-count histograms span the context (vLLM: 1-2-5 buckets up to max_model_len); this until
# `configure` says the model's.
DEFAULT_MAX_MODEL_LEN = 8192

FINISHED_REASONS = ("stop", "length", "abort", "error")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")
REJECT_REASONS = ("queue_full",)
# Engine-core stats keys that are cumulative counters.
_CUMULATIVE_STATS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
HIT_SOURCES = ("block", "checkpoint", "end_checkpoint")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class SampleStats:
    """One sample's timeline (frontend `time.monotonic()`) and counts, kept by the output processor."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


def cache_config_info(engine_args: Any, model_info: dict) -> dict[str, str]:
    """The `vllm:cache_config_info` labels (vLLM's CacheConfig field names, values as strings) that mean
    something here; the pool is host memory, vLLM's "gpu" blocks."""
    fields = {  # vLLM's name -> EngineArgs field
        "block_size": "block_size",
        "enable_prefix_caching": "enable_prefix_caching",
        "prefix_caching_hash_algo": "prefix_caching_hash_algo",
        "num_gpu_blocks_override": "num_kv_blocks",
        "kv_cache_memory_bytes": "kv_cache_memory_bytes",
        "mamba_cache_mode": "mamba_cache_mode",
    }
    info = {name: str(getattr(engine_args, field, None)) for name, field in fields.items()}
    info["cache_dtype"] = str(getattr(engine_args, "kv_cache_dtype", "auto"))
    info["num_gpu_blocks"] = str(model_info.get("num_kv_blocks"))
    return info


class EngineMetrics:
    """The server's metrics. Not thread-safe by design: only the frontend's event loop records."""

    def __init__(
        self,
        model_name: str | list[str],
        registry: CollectorRegistry | None = None,
        *,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collectors: list[Any] = []
        # Samples in flight -> when the core first scheduled them (None until it says so).
        self._first_scheduled: dict[str, float | None] = {}
        self._last_cumulative: dict[str, float] = {}
        self._last_step = 0
        self._build(_first_name(model_name), max_model_len)

    def configure(
        self, max_model_len: int, cache_info: dict[str, str] | None = None, model_name: str | None = None
    ) -> None:
        """Rebuild for the loaded model: token-count buckets up to its context, `vllm:cache_config_info`,
        and optionally another model name. Call it before the first request: values so far are dropped."""
        for collector in self._collectors:
            self.registry.unregister(collector)
        self._collectors = []
        self._build(model_name or self.model_name, max_model_len)
        if cache_info:
            info = self._register(
                Gauge,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labelnames=sorted({*cache_info, "engine"}),
            )
            info.labels(**cache_info, engine=ENGINE_INDEX).set(1)

    # ------------------------------------------------------------------ the families

    def _register(self, cls: type, name: str, doc: str, **kwargs: Any) -> Any:
        collector = cls(name, doc, registry=self.registry, **kwargs)
        self._collectors.append(collector)
        return collector

    def _one(self, cls: type, name: str, doc: str, **kwargs: Any) -> Any:
        """A family with the common labels only, and its one child."""
        return self._register(cls, name, doc, labelnames=LABELS, **kwargs).labels(*self._labels)

    def _by(self, cls: type, name: str, doc: str, label: str, values: Iterable[str]) -> dict[str, Any]:
        """A family with one more label, and a child per value (all exported from the start, as vLLM's)."""
        family = self._register(cls, name, doc, labelnames=(*LABELS, label))
        return {v: family.labels(*self._labels, v) for v in values}

    def _build(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._labels = (model_name, ENGINE_INDEX)
        self._build_scheduler_state()
        self._build_token_counters()
        self._build_request_histograms(build_1_2_5_buckets(max_model_len))
        self._build_latency_histograms()
        self._build_spec_decode()
        self._build_tokenos()

    def _build_scheduler_state(self) -> None:
        self.num_running = self._one(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_waiting = self._one(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        # vLLM's labels (no model_name / engine); one child: the current running / waiting adapters.
        self.lora_info = self._register(
            Gauge,
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labelnames=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self.waiting_by_reason = self._by(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason: 'capacity' = waiting for a seat, memory or budget; "
            "'deferred' = an n > 1 sample parked until its first sample has computed the prompt.",
            "reason",
            WAITING_REASONS,
        )
        usage_doc = "KV-cache usage. 1 means 100 percent usage."
        self.kv_cache_usage = [
            self._one(Gauge, "vllm:kv_cache_usage_perc", usage_doc),
            self._one(
                Gauge, "vllm:gpu_cache_usage_perc", usage_doc + " DEPRECATED: use vllm:kv_cache_usage_perc."
            ),
        ]
        queries = "Prefix cache queries, in terms of number of queried tokens."
        hits = "Prefix cache hits, in terms of number of cached tokens."
        old = " DEPRECATED: use vllm:prefix_cache_{}."
        self.engine_counters = {
            "prefix_cache_queries": [
                self._one(Counter, "vllm:prefix_cache_queries", queries),
                self._one(Counter, "vllm:gpu_prefix_cache_queries", queries + old.format("queries")),
            ],
            "prefix_cache_hits": [
                self._one(Counter, "vllm:prefix_cache_hits", hits),
                self._one(Counter, "vllm:gpu_prefix_cache_hits", hits + old.format("hits")),
            ],
            "num_preemptions": [
                self._one(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
            ],
        }
        self.iteration_tokens = self._one(
            Histogram,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_TOKEN_BUCKETS,
        )

    def _build_token_counters(self) -> None:
        # Plain running totals of the two token counters, for the periodic stats line (stat_logger.py).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.prompt_tokens = self._one(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = self._by(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            PROMPT_TOKEN_SOURCES,
        )
        self.prompt_tokens_cached = self._one(
            Counter, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = self._one(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = self._by(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests (by finished_reason: aborts and errors too).",
            "finished_reason",
            FINISHED_REASONS,
        )

    def _build_request_histograms(self, token_buckets: list[int]) -> None:
        def tokens(name: str, doc: str) -> Histogram:
            return self._one(Histogram, name, doc, buckets=token_buckets)

        self.request_prompt_tokens = tokens(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed."
        )
        self.request_generation_tokens = tokens(
            "vllm:request_generation_tokens", "Number of generation tokens processed."
        )
        self.request_max_generation_tokens = tokens(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
        )
        self.request_max_tokens = tokens(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."
        )
        self.request_prefill_kv_computed = tokens(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        )
        self.request_n = self._one(
            Histogram, "vllm:request_params_n", "Histogram of the n request parameter.", buckets=N_BUCKETS
        )

    def _build_latency_histograms(self) -> None:
        def seconds(name: str, doc: str, buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS) -> Histogram:
            return self._one(Histogram, name, doc, buckets=buckets)

        self.ttft = seconds(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = [
            seconds(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            seconds(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds. "
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                ITL_BUCKETS,
            ),
        ]
        self.request_tpot = seconds(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = seconds("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue_time = seconds(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."
        )
        self.inference_time = seconds(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."
        )
        self.prefill_time = seconds(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."
        )
        self.decode_time = seconds(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."
        )

    def _build_spec_decode(self) -> None:
        """vLLM's speculative-decoding counters (0 while speculation is off); the per-position children
        appear as the core reports positions."""
        self.spec_counters = {
            key: self._one(Counter, f"vllm:spec_decode_{key}", doc)
            for key, doc in (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens."),
            )
        }
        self.spec_per_pos = self._register(
            Counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labelnames=(*LABELS, "position"),
        )

    def _add_spec_increase(self, spec: dict[str, Any]) -> None:
        for key, counter in self.spec_counters.items():
            counter.inc(self._increase(f"spec:{key}", spec.get(key, 0)))
        for pos, value in enumerate(spec.get("accepted_per_pos", ())):
            self.spec_per_pos.labels(*self._labels, str(pos)).inc(self._increase(f"spec_pos:{pos}", value))

    def _build_tokenos(self) -> None:
        self.rejected = self._by(
            Counter,
            "tokenos:request_rejected",
            "Requests refused before the engine, by reason (queue_full: HTTP 429).",
            "reason",
            REJECT_REASONS,
        )
        self.engine_dead = self._one(
            Gauge, "tokenos:engine_dead", "1 once the engine core has died (the server exits)."
        )
        self.engine_deaths = self._one(
            Counter, "tokenos:engine_core_deaths", "Times the engine core died (it is not restarted)."
        )
        self.hits_by_source = self._by(
            Counter,
            "tokenos:prefix_cache_hit_tokens_by_source",
            "Prefix-cache hit tokens by what they resumed from: block (full blocks), and for hybrid models "
            "checkpoint (a page boundary or interval checkpoint of the recurrent state) or end_checkpoint "
            "(a finished request's exact end state).",
            "source",
            HIT_SOURCES,
        )
        self.group_pages = self._register(
            Gauge,
            "tokenos:kv_cache_group_pages",
            "Pages held by requests per KV-cache group (kind mamba: recurrent-state pages), at scrape time.",
            labelnames=(*LABELS, "group", "kind"),
        )
        self.group_hit_pages = self._register(
            Counter,
            "tokenos:prefix_cache_hit_pages",
            "Pages prefix-cache hits took from each KV-cache group (kind mamba: the recurrent-state page "
            "resumed from), read at scrape time.",
            labelnames=(*LABELS, "group", "kind"),
        )

    # ------------------------------------------------------------------ frontend, per sample

    def new_sample(
        self, request_id: str, arrival_time: float, num_prompt_tokens: int, max_tokens: int | None
    ) -> SampleStats:
        """A sample enters the engine; the core will say when it first schedules it."""
        self._first_scheduled[request_id] = None
        return SampleStats(request_id, arrival_time, num_prompt_tokens, max_tokens)

    def observe_tokens(
        self, sample: SampleStats, num_new: int, now: float, num_cached_tokens: int = 0
    ) -> None:
        """`num_new` more tokens of `sample` reached the frontend at `now` (one output)."""
        if num_new <= 0:
            return
        self.generation_tokens.inc(num_new)
        self.total_generation_tokens += num_new
        if sample.first_token_time is None:
            sample.first_token_time = now
            self.ttft.observe(max(now - sample.arrival_time, 0.0))
            self._observe_prefill_done(sample, num_cached_tokens)
        else:
            for itl in self.itl:
                itl.observe(max(now - sample.last_token_time, 0.0))
        sample.last_token_time = now
        sample.num_generation_tokens += num_new

    def _observe_prefill_done(self, sample: SampleStats, num_cached_tokens: int) -> None:
        """The prompt is computed (vLLM counts prompt tokens then, split by where their KV came from)."""
        total = sample.num_prompt_tokens
        cached = min(max(num_cached_tokens, 0), total)
        sample.num_cached_tokens = cached
        self.prompt_tokens.inc(total)
        self.total_prompt_tokens += total
        self.prompt_tokens_cached.inc(cached)
        self.prompt_tokens_by_source["local_cache_hit"].inc(cached)
        self.prompt_tokens_by_source["local_compute"].inc(total - cached)

    def observe_finished(self, sample: SampleStats, finished_reason: str, now: float) -> None:
        """`sample` ended (stop, length, abort: client gone or aborted, error: the engine failed it alone).

        Intervals that lack a timestamp (aborted before being scheduled, or before its first token) are not
        observed rather than observed as nonsense; counts and e2e latency always are."""
        scheduled = self._first_scheduled.pop(sample.request_id, None)
        reason = finished_reason if finished_reason in FINISHED_REASONS else "abort"
        self.request_success[reason].inc()
        self.e2e.observe(max(now - sample.arrival_time, 0.0))
        self.request_prompt_tokens.observe(sample.num_prompt_tokens)
        self.request_generation_tokens.observe(sample.num_generation_tokens)
        if sample.max_tokens:
            self.request_max_tokens.observe(sample.max_tokens)
        first, last = sample.first_token_time, sample.last_token_time
        if scheduled is not None:
            self.queue_time.observe(max(scheduled - sample.arrival_time, 0.0))
        if first is None:
            return
        self.request_prefill_kv_computed.observe(sample.num_prompt_tokens - sample.num_cached_tokens)
        decode = max(last - first, 0.0)
        self.decode_time.observe(decode)
        # As vLLM: the first token is the prefill's, and a one-token answer has a mean TPOT of 0.
        n = sample.num_generation_tokens
        self.request_tpot.observe(decode / (n - 1) if n > 1 else 0.0)
        if scheduled is not None:
            self.prefill_time.observe(max(first - scheduled, 0.0))
            self.inference_time.observe(max(last - scheduled, 0.0))

    def observe_parent_finished(self, n: int, max_generation_tokens: int) -> None:
        """A user request ended: all its `n` samples did; the longest generated `max_generation_tokens`."""
        self.request_n.observe(n)
        self.request_max_generation_tokens.observe(max_generation_tokens)

    def record_rejected(self, reason: str) -> None:
        """A request was refused before reaching the engine core (``queue_full``)."""
        self.rejected[reason].inc()

    def record_engine_death(self) -> None:
        self.engine_dead.set(1)
        self.engine_deaths.inc()

    # ------------------------------------------------------------------ engine core, per step

    def update_from_engine_stats(self, stats: dict[str, Any]) -> None:
        """Apply one engine-core stats dict (gauges now, counters cumulative since start, the last step)."""
        waiting = stats.get("num_waiting", 0)
        deferred = min(stats.get("num_waiting_deferred", 0), waiting)
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(waiting)
        self.waiting_by_reason["capacity"].set(waiting - deferred)
        self.waiting_by_reason["deferred"].set(deferred)
        for gauge in self.kv_cache_usage:
            gauge.set(stats.get("kv_cache_usage", 0.0))
        for key in _CUMULATIVE_STATS:
            if key in stats:
                self._add_increase(key, stats[key])
        for source, value in (stats.get("prefix_cache_hits_by_source") or {}).items():
            self._add_source_increase(source, value)
        if "spec_decoding" in stats:
            self._add_spec_increase(stats["spec_decoding"])
        if "lora" in stats:
            self._set_lora_info(stats["lora"])
        self._apply_step(stats)

    def _set_lora_info(self, lora: dict[str, Any]) -> None:
        labels = (str(lora["max_lora"]), ",".join(lora["waiting"]), ",".join(lora["running"]))
        if labels != self._lora_labels:  # the series names the adapters now, not every set ever seen
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def _add_source_increase(self, source: str, value: int) -> None:
        if source not in self.hits_by_source:
            return
        self.hits_by_source[source].inc(self._increase(f"hits_by_source:{source}", value))

    def update_kv_groups(self, groups: list[dict[str, Any]]) -> None:
        """The engine core's per-group pages (`EngineCore.get_kv_groups`), read at scrape time."""
        for g in groups:
            labels = (*self._labels, str(g["group"]), g["kind"])
            self.group_pages.labels(*labels).set(g["pages"])
            if "hit_pages" in g:
                increase = self._increase(f"hit_pages:{g['group']}", g["hit_pages"])
                self.group_hit_pages.labels(*labels).inc(increase)

    def _increase(self, key: str, value: float) -> float:
        """How much the core's cumulative count `key` grew since it was last read."""
        last = self._last_cumulative.get(key, 0)
        self._last_cumulative[key] = value
        # A smaller value means the core restarted its count (e.g. a prefix-cache reset): start over.
        return value - last if value >= last else value

    def _add_increase(self, key: str, value: float) -> None:
        increase = self._increase(key, value)
        for counter in self.engine_counters[key]:
            counter.inc(increase)

    def _apply_step(self, stats: dict[str, Any]) -> None:
        """The last step's part of the stats, once: the same step can be reported again (an idle core
        re-sends its stats)."""
        step = stats.get("num_steps")
        if step is None or step == self._last_step:
            return
        self._last_step = step
        if stats.get("step_tokens", 0) > 0:
            self.iteration_tokens.observe(stats["step_tokens"])
        first_scheduled = self._first_scheduled
        for request_id, when in (stats.get("first_scheduled") or {}).items():
            # Only samples in flight here: one this frontend already forgot (aborted) must not linger.
            if request_id in first_scheduled and first_scheduled[request_id] is None:
                first_scheduled[request_id] = when

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text format of every metric (the body of GET /metrics)."""
        return generate_latest(self.registry)


def _first_name(model_name: str | list[str]) -> str:
    """The served name labels the series; with several served names, the first (as vLLM)."""
    if isinstance(model_name, (list, tuple)):
        return str(model_name[0]) if model_name else "default"
    return model_name
