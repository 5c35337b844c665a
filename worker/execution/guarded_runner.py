"""Running batches under the governor: memory sampled around each, OOM batches split.

A batch goes through the executor's three steps (stage, launch, finish) as a RunningBatch,
so a compute loop can stage the next batch while this one computes. A failure in any step
is kept in the RunningBatch and dealt with in finish(): an out-of-memory batch frees cached
memory, lowers its bucket's ceiling and runs again as two halves, recursively, so no request
fails because of its batch-mates; only a request that runs out of memory alone is answered
`too_large`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from worker.execution.executor import Executor, Launched, Staged, is_out_of_memory
from worker.execution.memory import MemoryProbe
from worker.models.base import Prepared
from worker.observe import metrics
from worker.policy.batching import Batch
from worker.policy.governor import Governor, MemoryReading

log = structlog.get_logger("redbatch.runner")


@dataclass(frozen=True, slots=True)
class TooLarge:
    """The result for an input that runs out of memory even in a batch of its own."""

    message: str


@dataclass(slots=True)
class RunningBatch:
    """One batch on its way through stage -> launch -> finish."""

    batch: Batch
    items: list[Prepared]
    staged: Staged | None = None
    launched: Launched | None = None
    error: Exception | None = None
    started_ms: float = 0.0  # Unix ms at launch
    started_clock: float = 0.0  # perf_counter at launch
    compute_s: float = 0.0  # launch to results, set by finish()


def padded_tokens(items: Sequence[Prepared]) -> int:
    return len(items) * max((item.length for item in items), default=0)


def _without_frames(exc: Exception) -> Exception:
    """An OOM's traceback holds the frames, and so the tensors, of the failed batch."""
    return exc.with_traceback(None) if is_out_of_memory(exc) else exc


class BatchRunner:
    def __init__(self, executor: Executor, governor: Governor, memory: MemoryProbe,
                 model_name: str, clock: Callable[[], float] = time.monotonic,
                 governing: threading.Lock | None = None) -> None:
        """`governing`: held while the governor changes; model instances share the governor,
        and the batcher reads its caps under the same lock."""
        self.executor = executor
        self.governor = governor
        self.governing = governing or threading.Lock()
        self.memory = memory
        self.model_name = model_name
        self.clock = clock
        self.oom_events = 0
        self.splits = 0
        self._memory_gauges = [metrics.MEMORY_BYTES.labels(model_name, kind)  # set every batch
                               for kind in ("used", "limit", "reserved", "allocated")]
        self._publish_caps()

    # --- the pipelined steps ------------------------------------------------------------------

    def stage(self, batch: Batch) -> RunningBatch:
        """Collate and start copying (runs while the previous batch computes)."""
        running = RunningBatch(batch, [p.item for p in batch.members])
        if running.items:
            try:
                running.staged = self.executor.stage(running.items, batch.bucket)
            except Exception as exc:
                running.error = _without_frames(exc)
        return running

    def launch(self, running: RunningBatch) -> None:
        running.started_ms = time.time() * 1000
        running.started_clock = time.perf_counter()
        if running.staged is None:
            return
        self.memory.before_batch()
        try:
            running.launched = self.executor.launch(running.staged)
        except Exception as exc:
            running.error = _without_frames(exc)

    def finish(self, running: RunningBatch) -> list[Any]:
        """One result per member (a TooLarge for an input too large to run at all).

        Raises the model's error when the batch failed for a reason other than memory.
        """
        try:
            results = self._finish(running)
        finally:
            running.compute_s = time.perf_counter() - running.started_clock
        return results

    def _finish(self, running: RunningBatch) -> list[Any]:
        error = running.error
        if error is None:
            assert running.launched is not None, "finish() before launch()"
            try:
                results = self.executor.finish(running.launched)
            except Exception as exc:
                error = _without_frames(exc)
            else:
                self._observe(running.batch.bucket, running.items)
                return results
        if not is_out_of_memory(error):
            raise error
        # The failed attempt's tensors are dropped so their memory is free for the halves.
        running.staged = running.launched = running.error = None
        return self._recover(running.batch.bucket, running.items)

    # --- synchronous runs and OOM recovery ----------------------------------------------------

    def run(self, bucket: int, items: Sequence[Prepared]) -> list[Any]:
        """Run a batch now, splitting it if it runs out of memory."""
        self.memory.before_batch()
        try:
            results = self.executor.run(items, bucket)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        else:
            self._observe(bucket, items)
            return results
        return self._recover(bucket, items)  # outside `except`: the failed frames are gone

    def _recover(self, bucket: int, items: Sequence[Prepared]) -> list[Any]:
        self.memory.release_cache()
        tokens = padded_tokens(items)
        with self.governing:
            self.governor.on_out_of_memory(bucket, len(items), tokens, self.clock())
            self._publish_caps()
            log.warning("batch.out_of_memory", bucket=bucket, size=len(items),
                        padded_tokens=tokens, cap=self.governor.caps[bucket])
        self.oom_events += 1
        metrics.OOM_EVENTS.labels(self.model_name, str(bucket)).inc()
        if len(items) == 1:
            return [TooLarge(f"input of length {items[0].length} does not fit in memory "
                             "even alone")]
        self.splits += 1
        metrics.OOM_SPLITS.labels(self.model_name, str(bucket)).inc()
        half = (len(items) + 1) // 2
        return self.run(bucket, items[:half]) + self.run(bucket, items[half:])

    # --- memory -------------------------------------------------------------------------------

    def release_if_fragmented(self) -> None:
        """Fragmentation guard, called when idle: give back a large unused cache."""
        reading = self.memory.read()
        with self.governing:
            release = self.governor.should_release_cache(reading)
        if release:
            self.memory.release_cache()
            log.info("memory.cache_released", cached_bytes=reading.cached)

    def _observe(self, bucket: int, items: Sequence[Prepared]) -> None:
        reading = self.memory.read()
        self._publish_memory(reading)
        with self.governing:
            if self.governor.observe(bucket, padded_tokens(items), reading, self.clock()):
                self._publish_caps()
                log.info("governor.caps", memory_fraction=round(reading.fraction, 3),
                         caps=[(c.requests, c.tokens) for c in self.governor.caps])

    def _publish_memory(self, reading: MemoryReading) -> None:
        used, limit, reserved, allocated = self._memory_gauges
        used.set(reading.used)
        limit.set(reading.limit)
        reserved.set(reading.reserved)
        allocated.set(reading.allocated)

    def _publish_caps(self) -> None:
        for bucket, cap in enumerate(self.governor.caps):
            metrics.BATCH_CAP.labels(self.model_name, str(bucket), "requests").set(cap.requests)
            metrics.BATCH_CAP.labels(self.model_name, str(bucket), "tokens").set(cap.tokens)
