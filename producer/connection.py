"""The one place that turns a Redis URL (and a mode) into a client, sync or asyncio.

Three modes:

- a single Redis: `redis://`, `rediss://` (TLS) or `unix://`, as redis-py reads them;
- Sentinel: `redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/<db>]`
  (`rediss+sentinel://` for TLS, to the sentinels and to the master), through redis-py's
  `Sentinel(...).master_for(service)`: the client asks the sentinels for the master on
  every new connection, so it follows a failover. The credentials are the master's; sentinels
  that demand their own (`requirepass` in sentinel.conf) take `?sentinel_password=...`
  (and `sentinel_username`);
- Cluster (`cluster=True`): the URL is one seed node of a Redis Cluster, through redis-py's
  `RedisCluster`.

Query arguments (`?ssl_ca_certs=...&socket_timeout=...`) are redis-py's `from_url` ones and
apply in every mode. A URL that cannot be used raises `ConnectionSettingsError`, whose message
is one line for the user. This module is shared by the producer and the worker, so it imports
nothing from `worker/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
PLAIN_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_SENTINEL_PORT = 26379


class ConnectionSettingsError(ValueError):
    """The Redis URL (or its mode) cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Target:
    """What a URL names: the mode, and what the mode needs to connect."""

    mode: str  # "single", "sentinel" or "cluster"
    url: str
    tls: bool = False
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # query args, credentials, db


SENTINEL_CREDENTIALS = {"sentinel_username": "username", "sentinel_password": "password"}


def redacted(url: str) -> str:
    """The URL with its passwords (the master's, the sentinels') replaced by ***, for
    messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    query = re.sub(r"(?i)(\b(?:sentinel_)?password=)[^&]*", r"\1***", parts.query)
    return parts._replace(query=query).geturl()


def parse_target(url: str, cluster: bool = False) -> Target:
    """Read a URL into a Target; ConnectionSettingsError (one line) when it cannot be used."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SENTINEL_SCHEMES:
        if cluster:
            raise ConnectionSettingsError(
                f"Redis URL {redacted(url)}: redis_cluster takes a seed node's redis:// or "
                "rediss:// URL, not a Sentinel one")
        return _parse_sentinel(url, SENTINEL_SCHEMES[scheme])
    if scheme not in PLAIN_SCHEMES or (cluster and scheme == "unix"):
        allowed = "redis://, rediss://" if cluster else \
            "redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://"
        raise ConnectionSettingsError(
            f"Redis URL {redacted(url)!r} must start with one of {allowed}")
    try:
        options = redis.connection.parse_url(url)
    except ValueError as exc:
        raise ConnectionSettingsError(f"Redis URL {redacted(url)}: {exc}") from None
    return Target("cluster" if cluster else "single", url, scheme == "rediss", options=options)


def _parse_sentinel(url: str, tls: bool) -> Target:
    parts = urlsplit(url)
    where = f"Redis URL {redacted(url)}"
    credentials, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(h, where) for h in hosts.split(",") if h)
    if not sentinels:
        raise ConnectionSettingsError(f"{where}: names no sentinel (host:port[,host:port...])")
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConnectionSettingsError(f"{where}: the path must be /<service>[/<db>]")
    options = _query_options(parts.query, where)
    if len(path) == 2:
        if not path[1].isdigit():
            raise ConnectionSettingsError(f"{where}: database {path[1]!r} is not a number")
        options.setdefault("db", int(path[1]))
    if credentials:
        user, _, password = credentials.partition(":")
        if user:
            options["username"] = unquote(user)
        if password:
            options["password"] = unquote(password)
    return Target("sentinel", url, tls, sentinels, path[0], options)


def _host_port(text: str, where: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    host = host.strip("[]")
    if not host or (port and not port.isdigit()):
        raise ConnectionSettingsError(f"{where}: bad sentinel address {text!r} (host:port)")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def _query_options(query: str, where: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, values in parse_qs(query).items():
        parser: Any = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(values[0]) if parser else values[0]
        except (TypeError, ValueError):
            raise ConnectionSettingsError(f"{where}: invalid value for {name!r}") from None
    return options


def _sentinel_parts(target: Target, kwargs: dict[str, Any]) -> tuple[dict[str, Any],
                                                                      dict[str, Any]]:
    """(keyword arguments of each master connection, of each sentinel connection). The
    callers add a sentinel retry of none: a sentinel that fails is skipped for the next one
    at once (redis-py 8.0 retried each with backoff: 150 s to refuse a wrong password)."""
    master = {**target.options, **kwargs}
    if target.tls:
        master["ssl"] = True
    to_sentinel = {k: v for k, v in master.items()
                   if k.startswith(("socket_", "ssl")) or k == "health_check_interval"}
    for name, key in SENTINEL_CREDENTIALS.items():
        if name in master:
            to_sentinel[key] = master.pop(name)
    return master, to_sentinel


def sync_client(url: str, cluster: bool = False, password: str | None = None,
                **kwargs: Any) -> Any:
    """A redis-py client for the URL in its mode; `kwargs` go to every connection (e.g.
    socket_timeout, which must outlast any blocking command); `password`, for a URL without
    one (a separate setting: any characters, no URL encoding). Connects lazily."""
    target = parse_target(url, cluster)
    kwargs = _with_password(target, password, kwargs)
    try:
        if target.mode == "sentinel":
            master, to_sentinel = _sentinel_parts(target, kwargs)
            to_sentinel.setdefault("retry", Retry(NoBackoff(), 0))
            client = Sentinel(list(target.sentinels), sentinel_kwargs=to_sentinel).master_for(
                target.service, **master)
        elif target.mode == "cluster":  # connects to the seed node at once
            return _cluster(url, kwargs)
        else:
            client = redis.Redis.from_url(url, **kwargs)
        _check_options(client.connection_pool)
        return client
    except (TypeError, ValueError) as exc:  # e.g. an unknown query argument
        raise ConnectionSettingsError(f"Redis URL {redacted(url)}: {exc}") from None


def _with_password(target: Target, password: str | None,
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    if password is None:
        return kwargs
    if target.options.get("password"):  # which one would win differs by mode: refuse both
        raise ConnectionSettingsError(f"Redis URL {redacted(target.url)} has a password: "
                                      "give it there or in redis_password, not both")
    return {**kwargs, "password": password}


def _cluster(url: str, kwargs: dict[str, Any]) -> redis.RedisCluster:
    try:
        return redis.RedisCluster.from_url(url, **kwargs)
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: make it one
        raise redis.ConnectionError(f"no Redis Cluster at {redacted(url)}: {exc}") from None


def _check_options(pool: Any) -> None:
    """Connections are made lazily: build one (it does not connect), so that a URL argument
    the connection does not take fails here, as a settings error, not at the first call."""
    pool.connection_class(**pool.connection_kwargs)


def async_client(url: str, cluster: bool = False, password: str | None = None,
                 **kwargs: Any) -> Any:
    """The asyncio twin of sync_client; `connection_pool_class` (e.g. a blocking pool) is
    honoured for a single Redis and a Sentinel master."""
    target = parse_target(url, cluster)
    kwargs = _with_password(target, password, kwargs)
    try:
        if target.mode == "sentinel":
            master, to_sentinel = _sentinel_parts(target, kwargs)
            to_sentinel.setdefault("retry", AsyncRetry(NoBackoff(), 0))
            client = AsyncSentinel(list(target.sentinels), sentinel_kwargs=to_sentinel
                                   ).master_for(target.service, **master)
        elif target.mode == "cluster":  # connects on first use
            return aioredis.RedisCluster.from_url(url, **kwargs)
        else:  # Redis.from_url has no connection_pool_class (a BlockingConnectionPool's)
            pool_class = kwargs.pop("connection_pool_class", aioredis.ConnectionPool)
            client = aioredis.Redis.from_pool(pool_class.from_url(url, **kwargs))
        _check_options(client.connection_pool)
        return client
    except (TypeError, ValueError) as exc:
        raise ConnectionSettingsError(f"Redis URL {redacted(url)}: {exc}") from None


def is_cluster_client(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster | aioredis.RedisCluster)


def master_count(client: Any) -> int:
    """The masters of a cluster (1 for any other client)."""
    return len(client.get_primaries()) if is_cluster_client(client) else 1


def node_client(client: Any, key: str) -> Any:
    """The connection pool of the master that serves `key`'s slot (the client itself when
    it is not a cluster's): a write and its WAIT go on one connection of it, as WAIT only
    counts the replicas that have that connection's writes. redis-py's cluster-level wait()
    would go to whichever node it picks."""
    if not is_cluster_client(client):
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


CLUSTER_FAULTS = (redis.exceptions.MovedError, redis.ConnectionError, redis.TimeoutError,
                  redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
                  redis.exceptions.ReadOnlyError)


def follow_cluster(client: Any, exc: Exception) -> None:
    """After a fault on a node connection (node_client), let redis-py's slot table follow
    the cluster, as RedisCluster does for its own commands: MOVED patches the slot's owner;
    a lost or demoted node, or CLUSTERDOWN, has the table read again (best effort: the
    caller retries with backoff)."""
    if not is_cluster_client(client):
        return
    if isinstance(exc, redis.exceptions.MovedError):
        client.nodes_manager.move_slot(exc)
        return
    try:
        client.nodes_manager.initialize()
    except (redis.RedisError, redis.exceptions.RedisClusterException):
        pass  # no node answers yet: the next retry tries again


async def follow_cluster_async(client: Any, exc: Exception) -> None:
    """follow_cluster for an asyncio RedisCluster."""
    if not is_cluster_client(client):
        return
    if isinstance(exc, redis.exceptions.MovedError):
        await client.nodes_manager.move_slot(exc)
        return
    try:
        await client.nodes_manager.initialize()
    except (redis.RedisError, redis.exceptions.RedisClusterException):
        pass  # no node answers yet: the next retry tries again
