"""The gateway's Redis clients: a bounded pool that waits for a free connection, in every
mode `producer/connection.py` reads.

Why: redis-py's default pool refuses a call outright ("Too many connections") once its cap is
reached, so a burst of slow calls turned every other call, readiness included, into a 503.
A blocking pool makes a call wait up to `redis_pool_timeout_s` for a connection instead.
Readiness gets a client of its own (one connection), so a saturated pool cannot make a healthy
gateway look unready. On a Redis Cluster (`redis_cluster`), redis-py's RedisCluster holds
`max_connections` per node and has no blocking pool: past the cap a call fails (a 503).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool

from producer import connection
from producer.gateway.settings import GatewaySettings

PROBE_TIMEOUT_S = 2.0  # a readiness probe answers within this, Redis up or not


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel master's pool that waits for a free connection instead of failing."""


def bounded_client(settings: GatewaySettings, size: int, wait_s: float,
                   **kwargs: Any) -> Any:
    """An asyncio client holding at most `size` connections; a call waits up to `wait_s`
    for one, then raises redis.ConnectionError."""
    secret = settings.redis_password
    password = None if secret is None else secret.get_secret_value()
    if settings.redis_cluster:  # a pool per node, no blocking pool class to give it
        return connection.async_client(settings.redis_url, cluster=True, password=password,
                                       max_connections=size, **kwargs)
    mode = connection.parse_target(settings.redis_url).mode
    pool_class = BlockingSentinelConnectionPool if mode == "sentinel" else \
        BlockingConnectionPool
    return connection.async_client(
        settings.redis_url, password=password,
        connection_pool_class=pool_class, max_connections=size, timeout=wait_s, **kwargs)


def shared_client(settings: GatewaySettings) -> Any:
    """The client every route shares."""
    return bounded_client(settings, settings.redis_pool_size, settings.redis_pool_timeout_s)


def probe_client(settings: GatewaySettings) -> Any:
    """Readiness's own client: one connection, short socket timeouts."""
    return bounded_client(settings, 1, PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S,
                          socket_connect_timeout=PROBE_TIMEOUT_S)
