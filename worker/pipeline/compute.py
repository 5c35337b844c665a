"""A compute loop: one per model instance, taking batches from the one batcher.

It runs in the worker's main thread (instance 0) or a `redbatch-compute-<n>` thread. It
never reads from or writes to Redis: batches come from the batcher, answers go to the
reply thread's queue. Batch N+1 is staged (collated, copied to the device) while batch N
computes, unless another instance is idle and can start it at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from worker.execution.runner import BatchRunner, RunningBatch
from worker.observe import metrics
from worker.pipeline.answers import (
    Answer,
    AnswerQueue,
    expired_answers,
    failed_answers,
    result_answers,
)
from worker.pipeline.inflight import InFlight
from worker.pipeline.retry import Grace
from worker.policy.batching import Batch, Batcher
from worker.policy.flow import entry_time_ms, queue_waits_ms, yields_to_idle

log = structlog.get_logger("redbatch.worker")
IDLE_POLL_S = 0.5  # an idle instance re-checks for the end of reading this often


@dataclass(frozen=True, slots=True)
class ComputeConfig:
    model_name: str
    consumer: str


class ComputeLoop:
    def __init__(self, config: ComputeConfig, runner: BatchRunner, batcher: Batcher,
                 inflight: InFlight, answers: AnswerQueue, grace: Grace) -> None:
        self.config = config
        self.runner = runner
        self.batcher = batcher
        self.inflight = inflight
        self.answers = answers
        self.grace = grace

    def run(self) -> None:
        """Double buffering: batch N+1 is staged (collated, copied) while batch N computes."""
        runner = self.runner
        running: RunningBatch | None = None
        while True:
            if running is None:
                runner.release_if_fragmented()  # about to wait: a moment to tidy memory
            batch = self.next_batch(block=running is None)
            if batch is None and running is None:
                return
            upcoming = runner.stage(batch) if batch is not None else None
            if running is not None:
                self.answers.put(self.complete(running))
            if upcoming is not None:
                runner.launch(upcoming)
            running = upcoming

    def next_batch(self, block: bool = True) -> Batch | None:
        """The batch that is due, waiting for one if `block`. None once reading has stopped
        and nothing is left, or the shutdown grace has passed (what is left stays pending for
        others); not blocking, also None when no batch is due yet, or when another instance
        is idle: it can start the batch now, rather than after our current one."""
        inflight = self.inflight
        with inflight.lock:
            while self.grace.left() > 0:
                if yields_to_idle(block, inflight.idle):
                    return None
                batch = self.batcher.next_batch(time.monotonic(), int(time.time() * 1000),
                                                inflight.should_flush())
                if batch is not None or not block:
                    return batch
                if not inflight.reading:
                    return None
                until_ready = self.batcher.seconds_until_ready(time.monotonic())
                inflight.idle += 1
                try:
                    inflight.work.wait(IDLE_POLL_S if until_ready is None else until_ready)
                finally:
                    inflight.idle -= 1
            return None

    def complete(self, running: RunningBatch) -> list[Answer]:
        """The batch's results (or its error) as answers, with its metrics recorded."""
        batch = running.batch
        answers = expired_answers(batch.expired)
        if not batch.members:
            return answers
        try:
            results = self.runner.finish(running)
        except Exception as exc:
            log.exception("batch.failed", bucket=batch.bucket, size=len(batch.members))
            return answers + failed_answers(batch.members, exc)
        enqueued_ms = [entry_time_ms(p.entry_id) for p in batch.members]
        queue_ms = queue_waits_ms(running.started_ms, enqueued_ms)
        record_batch(self.config.model_name, batch, running.compute_s, queue_ms)
        meta = {"model": self.config.model_name, "batch_size": len(batch.members),
                "compute_ms": round(running.compute_s * 1000, 3),
                "worker": self.config.consumer, "bucket": batch.bucket,
                "padded_length": batch.longest}
        return answers + result_answers(batch, results, meta, enqueued_ms, queue_ms)


def record_batch(model_name: str, batch: Batch, compute_s: float,
                 queue_ms: list[float]) -> None:
    bucket = str(batch.bucket)
    real, padded = batch.real_tokens, batch.padded_tokens
    metrics.BATCH_SIZE.labels(model_name, bucket).observe(len(batch.members))
    metrics.PADDED_TOKENS.labels(model_name, bucket).observe(padded)
    metrics.PADDING_EFFICIENCY.labels(model_name).observe(real / padded if padded else 1.0)
    metrics.REAL_TOKENS_TOTAL.labels(model_name).inc(real)
    metrics.PADDED_TOKENS_TOTAL.labels(model_name).inc(padded)
    metrics.COMPUTE_TIME.labels(model_name).observe(compute_s)
    metrics.observe_all(metrics.QUEUE_WAIT.labels(model_name), [ms / 1000 for ms in queue_ms])
    log.debug("batch.done", bucket=batch.bucket, size=len(batch.members), longest=batch.longest,
              padding_efficiency=round(real / padded, 3) if padded else 1.0,
              compute_ms=round(compute_s * 1000, 2))
