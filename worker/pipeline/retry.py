"""Redis faults: which are worth waiting out, and the retry helper that waits them out.

Every thread's Redis call goes through RedisRetry: a transient fault (Redis unreachable,
loading, full, read-only in a failover) is retried with backoff until it succeeds, or until
the shutdown grace has passed; anything else is a bug or a misconfiguration and is raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import structlog

from worker.policy.backoff import backoff_delays

log = structlog.get_logger("redbatch.worker")
T = TypeVar("T")

TRANSIENT_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError,  # MasterNotFoundError too
                          redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                          redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)


# Error prefixes a server answers while it cannot serve for a while: full under noeviction
# (Redis 6.2 reports it inside a script error), a demoted master or a replica during a
# failover (READONLY, MASTERDOWN), a master refusing writes under min-replicas-to-write
# (NOREPLICAS), a cluster without a master for some slot or mid-resharding.
TRANSIENT_MESSAGES = ("OOM command not allowed", "READONLY", "MASTERDOWN", "NOREPLICAS",
                      "CLUSTERDOWN", "TRYAGAIN")


def is_transient(exc: redis.RedisError) -> bool:
    """Worth waiting out: Redis unreachable or timing out (a master killed mid-call; under
    Sentinel, no master known yet), loading its data, full, or read-only or without a
    master during a failover. Anything else is a bug or a misconfiguration."""
    if isinstance(exc, TRANSIENT_REDIS_ERRORS):
        return True
    message = str(exc)
    return any(marker in message for marker in TRANSIENT_MESSAGES)


class ShutdownExpired(Exception):
    """The shutdown grace has passed: stop waiting for Redis; unanswered entries stay pending."""


class Grace:
    """The shutdown grace: endless while serving; once started, the moment to give up."""

    def __init__(self) -> None:
        self.ends_at = float("inf")  # monotonic seconds

    def start(self, seconds: float) -> None:
        if self.ends_at == float("inf"):
            self.ends_at = time.monotonic() + seconds

    def left(self) -> float:
        return self.ends_at - time.monotonic()


class RedisRetry:
    """Runs a Redis operation until it succeeds, waiting out transient faults.

    `on_fault` runs before each wait: a lost reply may have delivered entries to us, so the
    reader must drain its own pending entries again.
    """

    def __init__(self, grace: Grace, on_fault: Callable[[], None] = lambda: None) -> None:
        self.grace = grace
        self.on_fault = on_fault

    def __call__(self, operation: Callable[..., T], *args: Any) -> T:
        delays = backoff_delays()
        while True:
            try:
                return operation(*args)
            except redis.RedisError as exc:
                if not is_transient(exc):
                    raise
                left = self.grace.left()
                if left <= 0:
                    raise ShutdownExpired from exc
                delay = min(next(delays), left)
                log.warning("redis.unavailable", error=str(exc), retry_in_s=round(delay, 3))
                self.on_fault()
                time.sleep(delay)
