"""Prometheus metrics for the server: what the frontend sees per request, what the core reports per step.

Two sources feed one registry of our own (never the global one, so two engines in one process or
one test session do not collide):
- the frontend's output processing calls `record_first_token`, `record_token` and
  `record_finished` as a request's tokens arrive (latency histograms, token and request counters);
- the engine core's per-step stats dict goes to `update_from_engine_stats` (gauges are set; the
  core's counters are cumulative, so the increase since the last dict is added to ours).
Names follow vLLM's with a `tokenos:` prefix, so dashboards built for one read the other.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Buckets in seconds: TTFT spans queueing on a busy CPU; ITL is one decode step.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)

FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full",)
# Engine-core stats keys that are cumulative counters, and the metric each one feeds.
_CUMULATIVE_STATS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineMetrics:
    """The server's metrics. Not thread-safe by design: only the frontend's event loop records."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ["model_name", *extra], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        requests = counter(
            "tokenos:request_success", "Finished requests (samples) by finish reason.", ("finished_reason",)
        )
        self.requests_by_reason = {
            reason: requests.labels(finished_reason=reason, **labels) for reason in FINISH_REASONS
        }
        self.prompt_tokens = counter("tokenos:prompt_tokens", "Prompt tokens of finished requests.").labels(
            **labels
        )
        self.generation_tokens = counter("tokenos:generation_tokens", "Generated tokens.").labels(**labels)
        self.engine_counters = {
            "prefix_cache_queries": counter(
                "tokenos:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ).labels(**labels),
            "prefix_cache_hits": counter(
                "tokenos:prefix_cache_hits", "Prompt tokens found in the prefix cache."
            ).labels(**labels),
            "num_preemptions": counter(
                "tokenos:num_preemptions", "Requests preempted by the scheduler."
            ).labels(**labels),
        }
        self.num_running = gauge("tokenos:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("tokenos:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "tokenos:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )
        self.ttft = histogram("tokenos:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "tokenos:inter_token_latency_seconds", "Time between two outputs of a request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "tokenos:e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS
        )
        rejected = counter(
            "tokenos:request_rejected", "Requests refused before the engine, by reason.", ("reason",)
        )
        self.rejected = {reason: rejected.labels(reason=reason, **labels) for reason in REJECT_REASONS}
        self.engine_dead = gauge("tokenos:engine_dead", "1 once the engine core has died (the server exits).")
        self.engine_deaths = counter(
            "tokenos:engine_core_deaths", "Times the engine core died (it is not restarted)."
        ).labels(**labels)
        self._last_cumulative: dict[str, float] = {}

    # ------------------------------------------------------------------ frontend, per request

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def record_token(self, itl_s: float) -> None:
        """One more output of a running request, `itl_s` after its previous one."""
        self.itl.observe(itl_s)

    def record_finished(self, request: Any, now: float) -> None:
        """A request finished (any reason); `request` is the output processor's per-request state.

        Reads `request.arrival_time` (same clock as `now`), `request.prompt_token_ids`,
        `request.num_generation_tokens` and each `request.samples[i].finish_reason`.
        """
        self.e2e.observe(max(now - request.arrival_time, 0.0))
        self.prompt_tokens.inc(len(request.prompt_token_ids))
        self.generation_tokens.inc(request.num_generation_tokens)
        for sample in request.samples:
            reason = sample.finish_reason if sample.finish_reason in FINISH_REASONS else "abort"
            self.requests_by_reason[reason].inc()

    def record_rejected(self, reason: str) -> None:
        """A request was refused before reaching the engine core (``queue_full``)."""
        self.rejected[reason].inc()

    def record_engine_death(self) -> None:
        self.engine_dead.set(1)
        self.engine_deaths.inc()

    # ------------------------------------------------------------------ engine core, per step

    def update_from_engine_stats(self, stats: dict) -> None:
        """Apply one engine-core stats dict (gauges now, counters cumulative since start)."""
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_cache_usage.set(stats.get("kv_cache_usage", 0.0))
        for key in _CUMULATIVE_STATS:
            if key not in stats:
                continue
            value = stats[key]
            last = self._last_cumulative.get(key, 0)
            # A smaller value means the core restarted its count (e.g. a prefix-cache reset): start over.
            self.engine_counters[key].inc(value - last if value >= last else value)
            self._last_cumulative[key] = value

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text format of every metric (the body of GET /metrics)."""
        return generate_latest(self.registry)
