"""Which models exist, which have live workers, and of which kind, read from Redis
(XINFO and the workers' announcements), cached briefly.

A model exists when its request stream has the workers' consumer group; it is live when some
consumer of that group was seen within `live_worker_idle_s`: XINFO CONSUMERS `idle`, or the
`seen_ms` a worker announces every maintenance interval (`<ns>:workers:<model>`; before
Redis 7.2, `idle` counts only reads that delivered entries, so an idle worker looks gone).
The announcements also say the model's kind (liveness.Kind). The short cache keeps the
per-request cost off the hot path; each process keeps its own, so the gateway stays
stateless.

The list of models (/v1/models) comes from the registry the workers write with their
announcements (`<ns>:models`, protocol.models_key), then the listed models' workers hashes in
one pipeline: no SCAN of the keyspace, whose cost grows with every key in Redis (issue 30). A
model is listed when its registry entry and one of its workers were seen within
`live_worker_idle_s`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer import connection, protocol
from producer.liveness import Kind, announced, kind_of, live_workers, registry_seen_ms
from producer.shards import shard_stream_key


class ModelState(StrEnum):
    UNKNOWN = "unknown"  # no request stream, or no consumer group on it
    NO_WORKER = "no_worker"  # the group exists, no consumer seen recently
    LIVE = "live"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    state: ModelState
    kind: Kind | None = None  # None: no worker announced it
    created_s: int | None = None  # when its longest-running worker started


class Listed(NamedTuple):
    """A model with a live worker, as /v1/models lists it."""

    name: str
    created: int  # Unix seconds: when its longest-running live worker started
    kind: Kind | None  # None: its workers did not say, or disagree


class Discovery:
    """Model states per process, each reused for `cache_s` seconds when live."""

    def __init__(self, redis: aioredis.Redis, namespace: str, group: str, idle_s: float,
                 cache_s: float) -> None:
        self.redis = redis
        self.namespace = namespace
        self.group = group
        self.idle_ms = idle_s * 1000
        self.cache_s = cache_s
        self._live: dict[str, tuple[float, ModelInfo]] = {}  # until when, what
        self._listed: tuple[float, list[Listed]] | None = None  # until when, what
        self._sharded = connection.is_cluster_client(redis)

    def stream(self, model: str) -> str:
        """The model's stream; on a cluster its shard 0's, which every worker reads."""
        if self._sharded:
            return shard_stream_key(self.namespace, model, 0)
        return protocol.stream_key(self.namespace, model)

    async def info(self, model: str) -> ModelInfo:
        """The model's state; a live answer is cached, others are asked again each time."""
        cached = self._live.get(model)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        info = await self._read_info(model)
        if info.state is ModelState.LIVE:
            self._live[model] = (time.monotonic() + self.cache_s, info)
        return info

    async def _read_info(self, model: str) -> ModelInfo:
        stream = self.stream(model)
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such key, or not a stream
            return ModelInfo(ModelState.UNKNOWN)
        if not any(_text(g["name"]) == self.group for g in groups):
            return ModelInfo(ModelState.UNKNOWN)
        consumers = await self.redis.xinfo_consumers(stream, self.group)
        workers = announced(await self._hash(protocol.workers_key(self.namespace, model)))
        kind = kind_of(workers)
        starts = [w["started_ms"] for w in workers if isinstance(w.get("started_ms"), int)]
        created = min(starts) // 1000 if starts else None
        if any(int(c["idle"]) < self.idle_ms for c in consumers) or live_workers(
                workers, time.time() * 1000, self.idle_ms):
            return ModelInfo(ModelState.LIVE, kind, created)
        return ModelInfo(ModelState.NO_WORKER, kind, created)

    async def live_models(self) -> list[Listed]:
        """Every model with a live worker, sorted by name; created is when its
        longest-running live worker started (else the stream's oldest entry), kind what its
        live workers announce. Reused for `cache_s`."""
        if self._listed is not None and self._listed[0] > time.monotonic():
            return self._listed[1]
        now_ms = time.time() * 1000
        registry = await self._hash(protocol.models_key(self.namespace))
        models = sorted(_text(model) for model, entry in registry.items()
                        if registry_seen_ms(entry) > now_ms - self.idle_ms)
        async with self.redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hgetall(protocol.workers_key(self.namespace, model))
            hashes = await pipe.execute(raise_on_error=False) if models else []
        found = []
        for model, raw in zip(models, hashes, strict=True):
            raw = {} if isinstance(raw, Exception) else raw  # squatted by another type
            live = live_workers(announced(raw), now_ms, self.idle_ms)
            starts = [w["started_ms"] for w in live if isinstance(w.get("started_ms"), int)]
            if live:
                created = min(starts) // 1000 if starts else await self._created(
                    self.stream(model))
                found.append(Listed(model, created, kind_of(live)))
        self._listed = (time.monotonic() + self.cache_s, found)
        return found

    async def _hash(self, key: str) -> dict[Any, Any]:
        """HGETALL, empty when the key holds another type (a squatted internal key must not
        take every model's listing down with it)."""
        try:
            found: dict[Any, Any] = await self.redis.hgetall(key)
        except ResponseError:
            return {}
        return found

    async def _created(self, stream: str) -> int:
        try:
            info = await self.redis.xinfo_stream(stream)
        except ResponseError:  # no such stream (yet)
            return int(time.time())
        first = info.get("first-entry") or info.get("last-generated-id")
        entry_id = first[0] if isinstance(first, list | tuple) else first
        try:
            return int(_text(entry_id).split("-")[0]) // 1000 or int(time.time())
        except (TypeError, ValueError):
            return int(time.time())
