"""What bounds one gateway process against its HTTP callers: calls in flight, and the limits
the HTTP protocol enforces on each connection (transport.py reads them from the app).

The in-flight cap answers 429 with Retry-After past `max_concurrent_requests`, so a burst of
slow calls cannot pile up without end in one process (TEI's `max_concurrent_requests`). The
probes and /metrics are not counted: a full process must still say it is alive and ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.gateway.errors import ApiError
from producer.gateway.jsonio import FastJSONResponse

UNCOUNTED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-connection limits of the HTTP protocol (transport.GuardedHttpToolsProtocol)."""

    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


def limits_of(app: Any) -> HttpLimits:
    """The HttpLimits the gateway's app carries, found through uvicorn's wrappers (each keeps
    the app it wraps as `.app`); the defaults for any other app."""
    for _ in range(16):
        found = getattr(app, "http_limits", None)
        if isinstance(found, HttpLimits):
            return found
        app = getattr(app, "app", None)
        if app is None:
            break
    return HttpLimits()


def too_many_in_flight(limit: int) -> ApiError:
    return ApiError(429, f"more than {limit} requests in flight on this gateway process; "
                    "retry later", "too_many_requests", None,
                    {"Retry-After": str(RETRY_AFTER_S)})


class InFlightLimit:
    """An ASGI middleware answering 429 while `limit` counted calls are in flight; it also
    carries the process's HttpLimits for the protocol."""

    def __init__(self, app: Any, limit: int, http_limits: HttpLimits) -> None:
        self.app = app
        self.limit = limit
        self.http_limits = http_limits
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = too_many_in_flight(self.limit)
            response = FastJSONResponse(error.body(), status_code=error.status,
                                        headers=error.headers)
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
