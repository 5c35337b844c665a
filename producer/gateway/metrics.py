"""The gateway's Prometheus metrics: requests by route and status, and latency.

An ASGI middleware records every HTTP request, so error responses of any origin (a 404 from
the router, a 500) are counted as well. Routes are labelled by their template and unknown
paths as "other", which keeps the label set bounded. Each process has its own registry.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
REQUESTS = Counter("redbatch_gateway_requests", "HTTP requests by route and status",
                   ["route", "status"], registry=REGISTRY)
LATENCY = Histogram("redbatch_gateway_request_seconds", "HTTP request latency by route",
                    ["route"], registry=REGISTRY,
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                             5, 10, 30, 60))
INPUTS = Counter("redbatch_gateway_inputs", "embedding inputs submitted to the workers",
                 ["model"], registry=REGISTRY)
FOREIGN_ENVELOPES = Counter("redbatch_gateway_foreign_envelopes",
                            "replies dropped from the gateway's keys: they answer another id",
                            registry=REGISTRY)
BATCH_LINES = Counter("redbatch_gateway_batch_lines",
                      "batch lines this process's runner answered, by outcome", ["outcome"],
                      registry=REGISTRY)
BATCHES_HELD = Gauge("redbatch_gateway_batches_running",
                     "batches in progress whose lease this process's runner holds",
                     registry=REGISTRY)
BATCH_RATE = Gauge("redbatch_gateway_batch_lines_per_second",
                   "a running batch's lines answered per second since it started", ["batch"],
                   registry=REGISTRY)
BATCH_ETA = Gauge("redbatch_gateway_batch_eta_seconds",
                  "a running batch's seconds left at its rate so far", ["batch"],
                  registry=REGISTRY)
ROUTES = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/models",
          "/metrics", "/healthz", "/readyz")


def exposition() -> bytes:
    return generate_latest(REGISTRY)


class MetricsMiddleware:
    """Counts each HTTP request by route and status, and observes its duration."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = [500]
        started = time.perf_counter()

        async def record(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            REQUESTS.labels(route, str(status[0])).inc()
            LATENCY.labels(route).observe(time.perf_counter() - started)
