"""The clients' model discovery: which models have a live worker, and of which kind.

Read from the workers' announcements (the registry `<ns>:models` and `<ns>:workers:<model>`)
with the gateway's liveness rule (producer/liveness.py): a worker is live when it announced
itself within `idle_s`. Plain functions of a redis client (sync) and coroutines (asyncio).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from producer import protocol
from producer.liveness import (
    Kind,
    announced,
    kind_of,
    kind_said,
    live_workers,
    registry_entry,
    registry_seen_ms,
)

DEFAULT_IDLE_S = 30.0  # as the gateway's live_worker_idle_s
KNOWN_KIND_S = 60.0  # a model's kind, once announced, is reused this long
UNKNOWN_KIND_S = 2.0  # no announcement yet: asked again after this long


@dataclass(frozen=True, slots=True)
class LiveModel:
    name: str
    announced: Kind | None  # None: its workers did not say
    workers: int  # live workers

    @property
    def kind(self) -> str:
        return self.announced or "unknown"

    @property
    def generative(self) -> bool | None:
        return None if self.announced is None else self.announced is Kind.GENERATIVE


class ModelKind:
    """A client's cached answer to "what kind is the model?", so each submit need not ask."""

    def __init__(self) -> None:
        self.announced: Kind | None = None
        self._until = 0.0

    @property
    def generative(self) -> bool | None:
        return None if self.announced is None else self.announced is Kind.GENERATIVE

    def stale(self) -> bool:
        return time.monotonic() >= self._until

    def learn(self, workers_raw: Any, entry: Any) -> None:
        """From the workers hash (HGETALL) and the registry entry (HGET)."""
        raw = workers_raw if isinstance(workers_raw, dict) else {}
        kind = kind_of(announced(raw))
        if kind is None and entry is not None:
            kind = kind_said(registry_entry(entry))
        self.announced = kind
        self._until = time.monotonic() + (UNKNOWN_KIND_S if kind is None else KNOWN_KIND_S)


def kind_keys(namespace: str, model: str) -> tuple[str, str]:
    """(workers hash, registry hash) that say a model's kind."""
    return protocol.workers_key(namespace, model), protocol.models_key(namespace)


def _name(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def fresh_models(registry: dict[Any, Any], now_ms: float, idle_s: float) -> list[str]:
    """The registry's models seen within `idle_s`, sorted."""
    return sorted(_name(model) for model, entry in registry.items()
                  if registry_seen_ms(entry) > now_ms - idle_s * 1000)


def live_of(models: list[str], hashes: list[Any], now_ms: float,
            idle_s: float) -> dict[str, LiveModel]:
    """Each model with a live worker, from its workers hash."""
    found = {}
    for model, raw in zip(models, hashes, strict=True):
        raw = raw if isinstance(raw, dict) else {}  # squatted by another type
        live = live_workers(announced(raw), now_ms, idle_s * 1000)
        if live:
            found[model] = LiveModel(model, kind_of(live), len(live))
    return found


def live_models(redis: Any, namespace: str, idle_s: float = DEFAULT_IDLE_S
                ) -> dict[str, LiveModel]:
    """The models with a live worker, by name (sorted), read in two round trips."""
    now_ms = time.time() * 1000
    try:
        registry = redis.hgetall(protocol.models_key(namespace))
    except ResponseError:
        return {}
    models = fresh_models(registry, now_ms, idle_s)
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(protocol.workers_key(namespace, model))
    hashes = pipe.execute(raise_on_error=False) if models else []
    return live_of(models, hashes, now_ms, idle_s)


async def live_models_async(redis: Any, namespace: str, idle_s: float = DEFAULT_IDLE_S
                            ) -> dict[str, LiveModel]:
    """live_models for asyncio."""
    now_ms = time.time() * 1000
    try:
        registry = await redis.hgetall(protocol.models_key(namespace))
    except ResponseError:
        return {}
    models = fresh_models(registry, now_ms, idle_s)
    async with redis.pipeline(transaction=False) as pipe:
        for model in models:
            pipe.hgetall(protocol.workers_key(namespace, model))
        hashes = await pipe.execute(raise_on_error=False) if models else []
    return live_of(models, hashes, now_ms, idle_s)


def learn_kind(redis: Any, kind: ModelKind, namespace: str, model: str) -> None:
    """Refresh `kind` when stale (one round trip each of two keys)."""
    if not kind.stale():
        return
    workers, registry = kind_keys(namespace, model)
    try:
        kind.learn(redis.hgetall(workers), redis.hget(registry, model))
    except ResponseError:  # a key squatted by another type: no announcement to read
        kind.learn({}, None)


async def learn_kind_async(redis: Any, kind: ModelKind, namespace: str, model: str) -> None:
    """learn_kind for asyncio."""
    if not kind.stale():
        return
    workers, registry = kind_keys(namespace, model)
    try:
        kind.learn(await redis.hgetall(workers), await redis.hget(registry, model))
    except ResponseError:
        kind.learn({}, None)
