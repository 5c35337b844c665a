"""The metrics port's HTTP endpoints: /metrics, /healthz (alive) and /readyz (can serve).

prometheus-client's WSGI app serves /metrics; a small router in front of it answers the two
probes, and wsgiref runs it on a daemon thread, as prometheus-client's own server does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

ReadinessCheck = Callable[[], dict[str, bool]]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


CONNECTION_TIMEOUT_S = 10.0  # a scrape takes milliseconds: a silent connection is let go


class QuietHandler(WSGIRequestHandler):
    """No access log on stderr: probes every few seconds would drown the worker's logs.
    Each connection has a thread: `timeout` closes one that sends nothing, or too slowly."""

    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def respond(start_response: StartResponse, status: str, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data)))])
    return [data]


def router(metrics_app: WSGIApp, readiness: ReadinessCheck) -> WSGIApp:
    """/healthz: 200 while the process runs. /readyz: 200 when every check passes, else 503
    naming the failing ones. Anything else goes to prometheus-client's /metrics app."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            return respond(start_response, "200 OK", {"status": "alive"})
        if path == "/readyz":
            checks = readiness()
            ready = bool(checks) and all(checks.values())
            return respond(start_response, "200 OK" if ready else "503 Service Unavailable",
                           {"ready": ready, "checks": checks})
        return metrics_app(environ, start_response)

    return app


def start_server(host: str, port: int, registry: CollectorRegistry,
                 readiness: ReadinessCheck,
                 timeout_s: float = CONNECTION_TIMEOUT_S) -> ThreadingWSGIServer:
    """Bind now (so a busy port fails at start-up) and serve on a daemon thread."""
    handler = type("TimedHandler", (QuietHandler,), {"timeout": timeout_s})
    server = make_server(host, port, router(make_wsgi_app(registry), readiness),
                         ThreadingWSGIServer, handler_class=handler)
    threading.Thread(target=server.serve_forever, name="redbatch-http", daemon=True).start()
    return server
