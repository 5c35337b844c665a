"""What /readyz checks: the model is loaded and warm, the worker is serving, Redis answers."""

from __future__ import annotations

from typing import Protocol

from worker.pipeline.worker import Worker


class RedisProbe(Protocol):
    def redis_reachable(self) -> bool: ...


class Readiness:
    """Filled in as start-up proceeds, so /healthz and /readyz answer while the model loads.

    `model`: the worker exists, which app.build_worker returns only once the model is loaded
    and warmed up. `serving`: the worker's `ready` event (its group exists and its threads
    run), and no shutdown begun. `redis`: the sampler read Redis recently.
    """

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.redis: RedisProbe | None = None

    def __call__(self) -> dict[str, bool]:
        worker, probe = self.worker, self.redis
        return {
            "model": worker is not None,
            "serving": worker is not None and worker.ready.is_set()
                       and not worker.stopping.is_set(),
            "redis": probe is not None and probe.redis_reachable(),
        }
