"""The HTTP and process series vLLM's server exports beside its engine metrics, on the same registry.

vLLM instruments its FastAPI app with prometheus-fastapi-instrumentator (defaults: `http_requests_total`
by handler / method / grouped status, `http_request_size_bytes` and `http_response_size_bytes` by handler,
`http_request_duration_seconds` by handler / method and `http_request_duration_highr_seconds`), leaving
out the probe routes, and its default registry carries prometheus_client's process, platform and garbage
collector series. tokenos uses the same library with the same settings, so dashboards and alerts built on
those series read it unchanged. The process series describe the API server process (the engine core is
another process, as in vLLM).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_fastapi_instrumentator import Instrumentator

# vLLM's list (vllm/entrypoints/serve/instrumentator/metrics.py): probes would drown the real traffic.
EXCLUDED_HANDLERS = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]


def instrument(app: Any, registry: CollectorRegistry) -> None:
    """Count every request `app` serves into `registry` (the one /metrics renders), and add the process,
    platform and GC collectors to it unless it is prometheus_client's global registry, which has them."""
    if not _has_process_series(registry):
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    Instrumentator(excluded_handlers=EXCLUDED_HANDLERS, registry=registry).add().instrument(app)


def _has_process_series(registry: CollectorRegistry) -> bool:
    # No public listing of a registry's collectors; prometheus_client has kept this map for years.
    return any(isinstance(c, ProcessCollector) for c in getattr(registry, "_collector_to_names", {}))
