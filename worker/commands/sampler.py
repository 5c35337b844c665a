"""A background thread that refreshes the gauges the hot path does not touch.

Every `interval_s` it copies the worker's own load (in-flight entries, queue depth per
bucket) and the queue's state in Redis (length, lag, pending, consumers, dead letters,
group throughput, drain estimate) into the Prometheus gauges. A successful Redis read also
marks Redis as reachable for /readyz, so the probe itself never waits on the network.
"""

from __future__ import annotations

import threading
import time

import redis
import structlog

from worker.observe import metrics
from worker.pipeline.worker import Worker
from worker.streams.queue_stats import RateMeter, StreamStats, drain_seconds, read_stream_stats

log = structlog.get_logger("redbatch.sampler")


class Sampler:
    def __init__(self, worker: Worker, client: redis.Redis, interval_s: float = 2.0) -> None:
        self.worker = worker
        self.client = client
        self.interval_s = interval_s
        self.rate = RateMeter()
        self._last_redis_ok: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redbatch-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def redis_reachable(self) -> bool:
        """Redis answered within the last three intervals."""
        last = self._last_redis_ok
        return last is not None and time.monotonic() - last < 3 * self.interval_s

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        self.sample_worker()
        try:
            stats = read_stream_stats(self.client, self.worker.settings.namespace,
                                      self.worker.name, self.worker.settings.group)
        except redis.RedisError as exc:
            log.debug("sampler.redis_unavailable", error=str(exc))
            return
        self._last_redis_ok = time.monotonic()
        self.rate.add(time.monotonic(), stats.answered)
        self.export(stats)

    def sample_worker(self) -> None:
        in_flight, depths = self.worker.load()
        name = self.worker.name
        metrics.IN_FLIGHT.labels(name).set(in_flight)
        for bucket, depth in enumerate(depths):
            metrics.QUEUE_DEPTH.labels(name, str(bucket)).set(depth)

    def export(self, stats: StreamStats) -> None:
        name = stats.model
        rate = self.rate.rate()
        metrics.STREAM_LENGTH.labels(name).set(stats.length)
        metrics.GROUP_LAG.labels(name).set(stats.lag)
        metrics.PENDING.labels(name).set(stats.pending)
        metrics.BACKLOG.labels(name).set(stats.backlog)
        metrics.CONSUMERS.labels(name).set(len(stats.consumers))
        metrics.DEAD_LETTER_LENGTH.labels(name).set(stats.dead_letters)
        if rate is not None:  # known from the second sample on
            metrics.THROUGHPUT.labels(name).set(rate)
            metrics.DRAIN_SECONDS.labels(name).set(drain_seconds(stats.backlog, rate))
