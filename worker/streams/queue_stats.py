"""The state of a model's queue as Redis holds it: stream, group, consumers, dead letters.

Read by the metrics sampler and by `python -m worker stats`. Redis 7 reports the group's lag
in XINFO GROUPS; on Redis 6.2 (or when 7 cannot tell) the producer's backlog script counts the
entries after the group's last-delivered id inside Redis, up to LAG_COUNT_CAP of them.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis

from producer import connection, protocol
from producer.backlog import BACKLOG, published_shards
from producer.shards import shard_answered_key, shard_dead_letter_key, shard_stream_key, shards_key
from worker.streams.reader import as_text

LAG_COUNT_CAP = 100_000
LIVE_WITHIN_MS = 30_000  # the gateway's default live_worker_idle_s: seen this recently is live


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    name: str
    pending: int
    idle_ms: int
    layout: str | None = None  # "2 instance(s) x 1 thread(s)", as the worker announced it
    # target_ms, observed_ms, percentile, margin_ms, batch_share (the steered share)
    latency: dict[str, float] | None = None
    dtype: str | None = None  # what the model computes in, as the worker announced it
    seen_ms: int | None = None  # when the worker last announced itself (None: never)
    live: bool = False  # announced within LIVE_WITHIN_MS (XINFO idle is no liveness signal)


@dataclass(frozen=True, slots=True)
class ShardStats:
    """One shard of a model's queue on a Redis Cluster, and the master that holds it."""

    shard: int
    node: str
    length: int
    lag: int
    pending: int
    dead_letters: int


@dataclass(frozen=True, slots=True)
class StreamStats:
    model: str
    length: int
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered, not yet acknowledged
    answered: int  # replies written since the stream began (a counter)
    dead_letters: int
    consumers: list[ConsumerStats] = field(default_factory=list)
    lag_capped: bool = False  # counted on Redis 6.2 and stopped at LAG_COUNT_CAP
    shards: list[ShardStats] = field(default_factory=list)  # on a cluster: each shard

    @property
    def backlog(self) -> int:
        """Requests still waiting for their answer."""
        return self.lag + self.pending

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "backlog": self.backlog}


def discover_models(client: redis.Redis, namespace: str) -> list[str]:
    """Models with a request stream in this namespace."""
    prefix = protocol.stream_key(namespace, "")
    keys = client.scan_iter(match=f"{prefix}*", count=1000, _type="STREAM")
    names = {as_text(key)[len(prefix):] for key in keys}
    if connection.is_cluster_client(client):  # {<model>:<shard>}
        names = {n[1:-1].rpartition(":")[0] for n in names if n[:1] == "{" and ":" in n}
    return sorted(names)


def count_undelivered(client: redis.Redis, stream: str, group: str, pending: int,
                      cap: int = LAG_COUNT_CAP) -> int:
    """The group's lag where Redis has no `lag`: its backlog (counted in Redis, at most `cap`
    undelivered entries) less its pending entries."""
    backlog: Any = client.register_script(BACKLOG)(keys=[stream], args=[group, cap])
    return max(0, int(backlog) - pending)


def read_stream_stats(client: redis.Redis, namespace: str, model: str,
                      group: str) -> StreamStats:
    """One snapshot of the model's queue; a missing stream or group reads as empty. On a
    cluster, the shards summed, each shard in `shards`."""
    if connection.is_cluster_client(client):
        return read_sharded_stats(client, namespace, model, group)
    return _read(client, model, group, protocol.stream_key(namespace, model),
                 protocol.answered_key(namespace, model),
                 protocol.dead_letter_key(namespace, model),
                 protocol.workers_key(namespace, model))


def read_sharded_stats(client: Any, namespace: str, model: str, group: str) -> StreamStats:
    count = published_shards(client.get(shards_key(namespace, model))) or 0
    parts = [_read(client, model, group, shard_stream_key(namespace, model, s),
                   shard_answered_key(namespace, model, s),
                   shard_dead_letter_key(namespace, model, s),
                   protocol.workers_key(namespace, model)) for s in range(count)]
    consumers: dict[str, ConsumerStats] = {}
    for part in parts:
        for c in part.consumers:
            known = consumers.get(c.name)
            consumers[c.name] = c if known is None else replace(
                known, pending=known.pending + c.pending, idle_ms=min(known.idle_ms, c.idle_ms),
                live=known.live or c.live)
    shards = [ShardStats(s, client.get_node_from_key(
        shard_stream_key(namespace, model, s)).name, p.length, p.lag, p.pending,
        p.dead_letters) for s, p in enumerate(parts)]
    return StreamStats(model, sum(p.length for p in parts), sum(p.lag for p in parts),
                       sum(p.pending for p in parts), sum(p.answered for p in parts),
                       sum(p.dead_letters for p in parts), list(consumers.values()),
                       any(p.lag_capped for p in parts), shards)


def _read(client: Any, model: str, group: str, stream: str, answered_key: str,
          dead_key: str, workers_key: str) -> StreamStats:
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.get(answered_key)
    pipe.xlen(dead_key)
    pipe.hgetall(workers_key)
    length, answered, dead, workers = pipe.execute()
    info = next((g for g in _groups(client, stream) if as_text(g["name"]) == group), None)
    if info is None:
        return StreamStats(model, length, length, 0, int(answered or 0), dead)
    lag = info.get("lag")
    capped = False
    if lag is None:  # Redis 6.2, or 7 after deletions it cannot account for
        lag = count_undelivered(client, stream, group, info["pending"])
        capped = lag >= LAG_COUNT_CAP
    announced = {as_text(name): announcement(text) for name, text in workers.items()}
    consumers = [consumer_stats(c, announced.get(as_text(c["name"]), {}))
                 for c in client.xinfo_consumers(stream, group)]
    return StreamStats(model, length, lag, info["pending"], int(answered or 0), dead,
                       consumers, capped)


def announcement(text: bytes | str) -> dict[str, Any]:
    """What a worker announced of itself (streams/maintenance.py); {} if unreadable."""
    try:
        announced = json.loads(text)
    except ValueError:
        return {}
    return announced if isinstance(announced, dict) else {}


def consumer_stats(info: dict[str, Any], announced: dict[str, Any]) -> ConsumerStats:
    """A consumer as XINFO lists it, live or dead by its worker's announcement (`seen_ms`,
    as the gateway judges it): before Redis 7.2 `idle` grows while a live worker reads
    nothing, and a worker that died stays listed until removed."""
    layout, latency = announced.get("layout"), announced.get("latency")
    dtype, seen = announced.get("dtype"), announced.get("seen_ms")
    why = announced.get("dtype_why")
    if isinstance(dtype, str) and isinstance(why, str):
        dtype = f"{dtype} ({why})"
    seen = seen if isinstance(seen, int) else None
    return ConsumerStats(as_text(info["name"]), info["pending"], info["idle"],
                         layout if isinstance(layout, str) else None,
                         latency if isinstance(latency, dict) else None,
                         dtype if isinstance(dtype, str) else None, seen,
                         seen is not None and time.time() * 1000 - seen < LIVE_WITHIN_MS)


def _groups(client: redis.Redis, stream: str) -> list[dict[str, Any]]:
    try:
        return list(client.xinfo_groups(stream))
    except redis.ResponseError:  # no such stream
        return []


class RateMeter:
    """Replies per second over a sliding window of counter readings (pure: times passed in)."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._readings: deque[tuple[float, int]] = deque()

    def add(self, now: float, answered: int) -> None:
        if self._readings and answered < self._readings[-1][1]:
            self._readings.clear()  # the counter was reset (flushed Redis): start over
        self._readings.append((now, answered))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()

    def rate(self) -> float | None:
        """None until two readings exist."""
        if len(self._readings) < 2:
            return None
        (t0, n0), (t1, n1) = self._readings[0], self._readings[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def drain_seconds(backlog: int, rate: float | None) -> float:
    """Time to answer the backlog at `rate`: 0 when empty, +Inf when nothing is moving."""
    if backlog <= 0:
        return 0.0
    if not rate or rate <= 0:
        return float("inf")
    return backlog / rate
