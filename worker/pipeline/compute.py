"""A compute loop: one per model instance, taking batches from the one batcher.

It runs in the worker's main thread (instance 0) or a `redbatch-compute-<n>` thread. It
never reads from or writes to Redis: batches come from the batcher, answers go to the
reply thread's queue. Batch N+1 is staged (collated, copied to the device) while batch N
computes, unless another instance is idle and can start it at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from worker.execution.guarded_runner import BatchRunner, RunningBatch
from worker.observe import metrics
from worker.pipeline.answers import (
    Answer,
    AnswerQueue,
    expired_answers,
    failed_answers,
    overloaded_answers,
    result_answers,
)
from worker.pipeline.inflight import InFlight
from worker.pipeline.retry import Grace
from worker.policy.batching import Batch, Batcher
from worker.policy.controllers import BatchController, Controlled, with_controlled
from worker.policy.flow import queue_waits_ms, yields_to_idle
from worker.policy.latency import LatencyPolicy

log = structlog.get_logger("redbatch.worker")
IDLE_POLL_S = 0.5  # an idle instance re-checks for the end of reading this often


@dataclass(frozen=True, slots=True)
class ComputeConfig:
    model_name: str
    consumer: str


class ComputeLoop:
    def __init__(self, config: ComputeConfig, runner: BatchRunner, batcher: Batcher,
                 inflight: InFlight, answers: AnswerQueue, grace: Grace,
                 latency: LatencyPolicy, instance: int = 0,
                 controller: BatchController | None = None) -> None:
        """`latency`: told when each batch starts and ends (busy-until, service times).
        `controller`: a baseline (`batch_controller`) that moves the batcher's limits after
        each batch; it is shared by the instances, under the worker's lock."""
        self.config = config
        self.runner = runner
        self.batcher = batcher
        self.inflight = inflight
        self.answers = answers
        self.grace = grace
        self.latency = latency
        self.instance = instance
        self.controller = controller

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
                # Stamped before launch: on a CPU, launch itself runs the forward pass.
                self._started(upcoming.batch)
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
                now_ms = int(time.time() * 1000)
                start_in_ms = 0.0 if block else self.latency.start_in_ms(self.instance, now_ms)
                batch = self.batcher.next_batch(time.monotonic(), now_ms,
                                                inflight.should_flush(), start_in_ms)
                if batch is not None or not block:
                    return batch
                if not inflight.reading:
                    return None
                until_ready = self.batcher.seconds_until_ready(time.monotonic(), now_ms)
                inflight.idle += 1
                try:
                    inflight.work.wait(IDLE_POLL_S if until_ready is None else until_ready)
                finally:
                    inflight.idle -= 1
            return None

    def complete(self, running: RunningBatch) -> list[Answer]:
        """The batch's results (or its error) as answers, with its metrics recorded."""
        batch = running.batch
        answers = expired_answers(batch.expired) + overloaded_answers(batch.refused,
                                                                      batch.retry_after_ms)
        if not batch.members:
            return answers
        try:
            results = self.runner.finish(running)
        except Exception as exc:
            log.exception("batch.failed", bucket=batch.bucket, size=len(batch.members))
            return answers + failed_answers(batch.members, exc)
        enqueued_ms = [p.enqueued_ms for p in batch.members]  # read once, at add()
        queue_ms = queue_waits_ms(running.started_ms, enqueued_ms)
        record_batch(self.config.model_name, batch, running.compute_s, queue_ms)
        self._finished(batch, running.compute_s, enqueued_ms)
        meta = {"model": self.config.model_name, "batch_size": len(batch.members),
                "compute_ms": round(running.compute_s * 1000, 3),
                "worker": self.config.consumer, "bucket": batch.bucket,
                "padded_length": batch.longest}
        return answers + result_answers(batch, results, meta, enqueued_ms, queue_ms)

    def _started(self, batch: Batch) -> None:
        if batch.members:
            with self.inflight.lock:
                self.latency.started(self.instance, batch.bucket, len(batch.members),
                                     batch.longest, time.time() * 1000)

    def _steer_batch_lines(self, now_ms: float) -> float | None:
        """Under a latency target, batch jobs' lines take the time it leaves: their share,
        steered by the online percentile (policy/background.py); None without a target."""
        if self.latency.target_ms == float("inf"):
            return None
        background = self.batcher.background
        background.steer(self.latency.margin.observed.value(0.0), self.latency.target_ms,
                         now_ms)
        return background.share

    def _finished(self, batch: Batch, compute_s: float, enqueued_ms: Sequence[int]) -> None:
        """The measured time refits the service-time model; its costs are exported. A
        baseline controller sees the members' latencies from their XADD time until now; the
        batcher's dispatch rule (cork's fit) the service time."""
        controlled: Controlled | None = None
        with self.inflight.lock:
            now_ms = time.time() * 1000
            self.latency.finished(self.instance, batch.bucket, len(batch.members),
                                  batch.longest, compute_s * 1000, now_ms)
            fit = self.latency.model.fit(batch.bucket)
            fixed, per_token = fit.fixed, fit.per_token
            self.batcher.finished(batch, compute_s * 1000, int(now_ms))
            share = self._steer_batch_lines(now_ms)
            if self.batcher.targeted is not None:
                self.batcher.targeted.finished(batch, compute_s * 1000)
            if self.controller is not None:
                controlled = self.controller.observe(compute_s * 1000,
                                                     [now_ms - at for at in enqueued_ms])
                self.batcher.limits = with_controlled(self.batcher.limits, controlled)
        name = self.config.model_name
        bucket = str(batch.bucket)
        if share is not None:
            metrics.BATCH_LINE_SHARE.labels(name).set(share)
        metrics.SERVICE_COST.labels(name, bucket, "fixed").set(fixed / 1000)
        metrics.SERVICE_COST.labels(name, bucket, "per_token").set(per_token / 1000)
        if controlled is not None:
            metrics.CONTROLLED_LIMIT.labels(name, "max_batch_size").set(controlled.max_batch_size)
            metrics.CONTROLLED_LIMIT.labels(name, "max_wait_seconds").set(controlled.max_wait_s)


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
    metrics.DISPATCHES.labels(model_name, batch.reason).inc()
    if batch.slack_ms is not None:
        metrics.DISPATCH_SLACK.labels(model_name).observe(batch.slack_ms / 1000)
    log.debug("batch.done", bucket=batch.bucket, size=len(batch.members), longest=batch.longest,
              padding_efficiency=round(real / padded, 3) if padded else 1.0,
              compute_ms=round(compute_s * 1000, 2), reason=batch.reason,
              slack_ms=None if batch.slack_ms is None else round(batch.slack_ms, 1))
