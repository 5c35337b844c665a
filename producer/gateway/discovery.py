"""Which models exist and which have live workers, read from Redis (XINFO), cached briefly.

A model exists when its request stream has the workers' consumer group; it is live when some
consumer of that group was seen within `live_worker_idle_s` (XINFO CONSUMERS `idle`). The
short cache keeps the per-request cost off the hot path; each process keeps its own, so the
gateway stays stateless.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer import protocol


class ModelState(StrEnum):
    UNKNOWN = "unknown"  # no request stream, or no consumer group on it
    NO_WORKER = "no_worker"  # the group exists, no consumer seen recently
    LIVE = "live"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Discovery:
    """Model states per process, each reused for `cache_s` seconds when live."""

    def __init__(self, redis: aioredis.Redis, namespace: str, group: str, idle_s: float,
                 cache_s: float) -> None:
        self.redis = redis
        self.namespace = namespace
        self.group = group
        self.idle_ms = idle_s * 1000
        self.cache_s = cache_s
        self._live_until: dict[str, float] = {}

    async def state(self, model: str) -> ModelState:
        """The model's state; a live answer is cached, others are asked again each time."""
        if self._live_until.get(model, 0.0) > time.monotonic():
            return ModelState.LIVE
        state = await self._read_state(protocol.stream_key(self.namespace, model))
        if state is ModelState.LIVE:
            self._live_until[model] = time.monotonic() + self.cache_s
        return state

    async def _read_state(self, stream: str) -> ModelState:
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such key, or not a stream
            return ModelState.UNKNOWN
        if not any(_text(g["name"]) == self.group for g in groups):
            return ModelState.UNKNOWN
        consumers = await self.redis.xinfo_consumers(stream, self.group)
        if any(int(c["idle"]) < self.idle_ms for c in consumers):
            return ModelState.LIVE
        return ModelState.NO_WORKER

    async def live_models(self) -> list[tuple[str, int]]:
        """(model, created Unix s) of every model with a live worker, sorted by name; created
        is the time of the stream's first entry id ever (the stream's creation, roughly)."""
        prefix = protocol.stream_key(self.namespace, "")
        found = []
        async for key in self.redis.scan_iter(match=f"{prefix}*", count=1000, _type="STREAM"):
            stream = _text(key)
            if await self._read_state(stream) is ModelState.LIVE:
                found.append((stream[len(prefix):], await self._created(stream)))
        return sorted(found)

    async def _created(self, stream: str) -> int:
        info = await self.redis.xinfo_stream(stream)
        first = info.get("first-entry") or info.get("last-generated-id")
        entry_id = first[0] if isinstance(first, list | tuple) else first
        try:
            return int(_text(entry_id).split("-")[0]) // 1000
        except (TypeError, ValueError):
            return int(time.time())
