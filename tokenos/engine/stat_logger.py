"""The periodic stats line a server operator reads, as vLLM prints it (unless ``--disable-log-stats``).

From a timer thread, every ``TOKENOS_LOG_STATS_INTERVAL_S`` seconds (10) while there is work: the prompt
and generation throughput since the last line, running and waiting requests, KV-cache usage, the
prefix-cache hit rate over the interval, and preemptions. It reads the engine core's latest stats and the
frontend's token totals (`EngineMetrics`); an idle engine prints one all-zero line and then stays quiet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger("tokenos.stats")


class StatLogger:
    def __init__(self, metrics: Any, interval_s: float | None = None) -> None:
        self.metrics = metrics
        self.interval_s = (
            float(os.environ.get("TOKENOS_LOG_STATS_INTERVAL_S", "10")) if interval_s is None else interval_s
        )
        self.last_time = time.monotonic()
        self.last_prompt = self.last_generation = 0
        self.last_queries = self.last_hits = 0
        self.was_idle = False

    def start(self, latest_stats: Any) -> None:
        """Print from a daemon thread every interval: ``latest_stats()`` gives the core's last stats."""
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.update(latest_stats() or {})
                except Exception:  # a stats line must never take the server down
                    logger.debug("stats line failed", exc_info=True)

        threading.Thread(target=loop, name="tokenos-stats", daemon=True).start()

    def stop(self) -> None:
        if getattr(self, "_stop", None) is not None:
            self._stop.set()

    def update(self, stats: dict[str, Any]) -> None:
        """One engine-core stats dict (every step, and while idle); prints when the interval is over."""
        now = time.monotonic()
        if now - self.last_time < self.interval_s:
            return
        line = self.line(stats, now)
        if line is not None:
            logger.info("%s", line)

    def line(self, stats: dict[str, Any], now: float) -> str | None:
        elapsed = max(now - self.last_time, 1e-9)
        prompt = self.metrics.total_prompt_tokens - self.last_prompt
        generation = self.metrics.total_generation_tokens - self.last_generation
        queries = stats.get("prefix_cache_queries", 0) - self.last_queries
        hits = stats.get("prefix_cache_hits", 0) - self.last_hits
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        self.last_time = now
        self.last_prompt += prompt
        self.last_generation += generation
        self.last_queries += queries
        self.last_hits += hits
        idle = not (prompt or generation or running or waiting)
        if idle and self.was_idle:
            return None
        self.was_idle = idle
        return (
            f"Engine 000: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * stats.get('kv_cache_usage', 0.0):.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries > 0 else 0.0:.1f}%, "
            f"Preemptions: {stats.get('num_preemptions', 0)}"
        )
