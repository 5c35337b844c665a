"""What the gateway logs: its start (which Redis, auth on or off, where it listens), Redis
outages and recoveries once each (not once per request), and one access line per request
at debug level.

The outage is noticed by a failing call; a watcher then pings Redis every
`RECOVERY_PING_S` on the readiness client until it answers, and logs the recovery.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import structlog
from redis.exceptions import RedisClusterException, RedisError

from producer import local_redis
from producer.connection import redacted
from producer.gateway.settings import GatewaySettings

log = structlog.get_logger("redbatch.gateway")
RECOVERY_PING_S = 1.0


def configure_logging(level: str) -> None:
    """JSON lines, or readable lines on a terminal, filtered at `level` (called by
    `python -m producer serve`, not by create_app: an embedding program keeps its own)."""
    renderer: Any = (structlog.dev.ConsoleRenderer() if sys.stderr.isatty()
                     else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))


def redis_source(settings: GatewaySettings) -> str:
    """Where the Redis URL came from, for the start line."""
    if "redis_url" in settings.model_fields_set:
        return "setting"
    if local_redis.local_url() == settings.redis_url:
        return str(local_redis.url_file())
    return "default"


def log_start(settings: GatewaySettings) -> None:
    """One line: the Redis (password masked), whether keys are required, the bind."""
    source = redis_source(settings)
    log.info("gateway.starting", redis=redacted(settings.redis_url), redis_from=source,
             redis_auth=bool(settings.redis_password) or "@" in settings.redis_url
             or "password=" in settings.redis_url,
             api_keys=len(settings.api_keys) > 0, bind=f"{settings.host}:{settings.port}",
             **({"hint": local_redis.HINT} if source == "default" else {}))


class RedisHealth:
    """Logs `redis.unavailable` at the first failure and `redis.recovered` once Redis
    answers again; failures in between go to the debug level only."""

    def __init__(self, probe: Any, url: str) -> None:
        self.probe = probe
        self.url = redacted(url)
        self.down_since: float | None = None
        self._watcher: asyncio.Task[None] | None = None

    def failed(self, route: str, exc: Exception) -> None:
        if self.down_since is not None:
            log.debug("redis.failed", route=route, error_type=type(exc).__name__,
                      error=str(exc))
            return
        self.down_since = time.monotonic()
        log.warning("redis.unavailable", redis=self.url, route=route,
                    error_type=type(exc).__name__, error=str(exc),
                    hint="answering 503 until Redis is back")
        try:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        except RuntimeError:  # no loop (a synchronous caller): the next failure retries
            self.down_since = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RECOVERY_PING_S)
            try:
                await self.probe.ping()
            except (RedisError, RedisClusterException, OSError):
                continue
            down_since, self.down_since = self.down_since or time.monotonic(), None
            log.info("redis.recovered", redis=self.url,
                     down_s=round(time.monotonic() - down_since, 1))
            return

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


class AccessLog:
    """ASGI middleware: one debug line per HTTP request (method, path, status, ms); nothing
    is formatted unless debug is on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not log.is_enabled_for(logging.DEBUG):
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [0]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log.debug("http.request", method=scope["method"], path=scope["path"],
                      status=status[0], ms=round((time.perf_counter() - started) * 1000, 1))
