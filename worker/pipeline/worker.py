"""The worker: threads joined by a bucketed batcher and a reply queue.

    reader thread     XREADGROUP -> validate -> decode -> model.prepare -> Batcher
    compute thread(s) Batcher.next_batch -> BatchRunner (the model)     -> reply queue
    reply thread      encode envelopes -> Lua reply+ack                  -> frees in-flight slots

There is one compute thread per model instance (`instances`): they take batches from the
one queue, like several servers at one counter, and share the weights and the governor.

Decoding and tokenising the next requests overlaps the compute of the current batch, the
next batch is collated and copied to the device while the current one runs (unless another
instance is free to start it at once), and replies are written while the next batch runs.
At most `max_inflight` entries are held between reading and answering, so other workers in
the group get the rest. The memory governor sets each bucket's batch caps; a batch that runs
out of memory is split and retried.

Reliability lives beside it: the reader also claims dead consumers' entries (reclaimer.py)
and diverts poison ones (deadletter.py); a maintenance thread trims and exports the backlog
(maintenance.py); on stop() what is held is answered within `shutdown_grace_s`.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import structlog

from producer import protocol
from producer.protocol import ErrorCode, InvalidEntry, Request
from worker.execution.executor import Executor
from worker.execution.memory import memory_probe
from worker.execution.runner import BatchRunner, Job, TooLarge
from worker.models.base import Model
from worker.observe import metrics
from worker.policy.batching import Batch, Batcher, BatchLimits, Pending
from worker.policy.governor import Governor, policy_from_settings
from worker.settings import Settings
from worker.streams.dead_letters import DeadLetters
from worker.streams.maintenance import Maintenance
from worker.streams.reader import Entry, StreamReader
from worker.streams.reclaimer import Reclaimer
from worker.streams.replier import Replier, Reply

log = structlog.get_logger("redbatch.worker")
T = TypeVar("T")
MAX_REPLIES_PER_CALL = 1024
UNMEASURED_MERGE_TOKENS = 32  # a small encoder's on CPU, until warm-up measures the model's


@dataclass(slots=True)
class Answer:
    """An envelope waiting to be encoded and written."""

    entry_id: str
    reply_to: str
    content_type: str
    envelope: dict[str, Any]
    enqueued_ms: int  # the XADD time, read from the entry id once per request

    @property
    def status(self) -> str:
        return "ok" if self.envelope["ok"] else self.envelope["error"]["code"]


def error_answer(entry_id: str, request: Request, code: ErrorCode, message: str) -> Answer:
    return Answer(entry_id, request.reply_to, request.content_type,
                  protocol.error_envelope(request.id, code, message), entry_time_ms(entry_id))


def entry_time_ms(entry_id: str) -> int:
    """Redis stream ids start with the XADD time in Unix milliseconds."""
    return int(entry_id.partition("-")[0])


TRANSIENT_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError,
                          redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


def is_transient(exc: redis.RedisError) -> bool:
    """Worth waiting out: Redis unreachable, loading its data, full (noeviction: Redis 6.2
    reports it inside a script error) or read-only during a failover. Anything else is a bug
    or a misconfiguration."""
    return isinstance(exc, TRANSIENT_REDIS_ERRORS) or "OOM command not allowed" in str(exc)


class ShutdownExpired(Exception):
    """The shutdown grace has passed: stop waiting for Redis; unanswered entries stay pending."""


def backoff_delays(base: float = 0.05, cap: float = 2.0) -> Iterator[float]:
    """Capped exponential backoff with full jitter."""
    delay = base
    while True:
        yield random.uniform(0, delay)
        delay = min(cap, delay * 2)


class Worker:
    def __init__(self, settings: Settings, model: Model, executor: Executor,
                 client: redis.Redis, calibrated: Mapping[int, int] | None = None) -> None:
        """`calibrated`: the best batch size per bucket boundary, from `python -m worker
        calibrate`; it lowers max_batch_size for that bucket."""
        self.settings = settings
        self.model = model
        self.executor = executor
        self.name = settings.model_name
        self.stream = protocol.stream_key(settings.namespace, self.name)
        self.reader = StreamReader(client, self.stream, settings.group, settings.consumer)
        self.replier = Replier(client, self.stream, settings.group, settings.consumer,
                               settings.result_ttl_ms,
                               protocol.answered_key(settings.namespace, self.name))
        self.reclaimer = Reclaimer(client, self.stream, settings.group, settings.consumer,
                                   settings.claim_idle_ms, self.name)
        self.dead_letters = DeadLetters(
            client, self.stream, settings.group, settings.consumer, namespace=settings.namespace,
            model_name=self.name, max_deliveries=settings.max_deliveries,
            result_ttl_ms=settings.result_ttl_ms, max_payload_bytes=settings.max_payload_bytes)
        self.maintenance = Maintenance(client, self.stream, settings.group, self.name,
                                       self.reclaimer, settings.maintenance_interval_s,
                                       settings.consumer_idle_ms)
        boundaries = settings.bucket_boundaries
        if boundaries is None:
            boundaries = list(model.default_bucket_boundaries)
        limits = BatchLimits(settings.max_batch_size, settings.max_batch_tokens,
                             settings.max_wait_ms / 1000)
        calibrated = calibrated or {}
        sizes = {i: calibrated[b] for i, b in enumerate(boundaries) if b in calibrated}
        self.governor = Governor(limits, len(boundaries) + 1, policy_from_settings(settings),
                                 sizes)
        self._lock = threading.Lock()  # guards batcher, governor, _held, _reading and _idle
        memory = memory_probe(executor.device, settings.memory_limit_bytes)
        executors = [executor] + [executor.another() for _ in range(settings.instances - 1)]
        self.runners = [BatchRunner(e, self.governor, memory, self.name, governing=self._lock)
                        for e in executors]  # one per model instance
        self.batcher = Batcher(boundaries, limits, caps=self.governor.limits)
        self.set_merge_tokens(UNMEASURED_MERGE_TOKENS if settings.merge_tokens is None
                              else settings.merge_tokens)
        # Two conditions on it, so each thread wakes only for what it waits for:
        self._room = threading.Condition(self._lock)  # answers written: in-flight slots free
        self._work = threading.Condition(self._lock)  # requests queued, or reading stopped
        self._held: set[str] = set()  # entry ids read and not yet answered
        self._reading = True
        self._idle = 0  # model instances waiting for a batch
        self._answers: queue.Queue[list[Answer] | None] = queue.Queue()
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.failed = False
        self._give_up_at = float("inf")  # monotonic time at which the shutdown grace ends

    # --- lifecycle ----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop() is called, then answer everything held and return."""
        self._retry(self.reader.ensure_group)
        reader = threading.Thread(target=self._read_loop, name="redbatch-reader", daemon=True)
        replier = threading.Thread(target=self._reply_loop, name="redbatch-replier", daemon=True)
        reader.start()
        replier.start()
        threading.Thread(target=self.maintenance.run, args=(self.stopping,),
                         name="redbatch-maintenance", daemon=True).start()
        instances = [threading.Thread(target=self._compute_thread, args=(runner,),
                                      name=f"redbatch-compute-{index}", daemon=True)
                     for index, runner in enumerate(self.runners[1:], start=1)]
        for instance in instances:
            instance.start()
        self.ready.set()
        log.info("worker.serving", stream=self.stream, group=self.settings.group,
                 consumer=self.settings.consumer, buckets=self.batcher.boundaries,
                 instances=len(self.runners))
        try:
            self._compute_thread(self.runner)  # the first instance computes in this thread
        finally:
            for instance in instances:
                instance.join()
            self._answers.put(None)
            replier.join()
            reader.join()
            log.info("worker.stopped", consumer=self.settings.consumer)

    def _fail(self, thread: str) -> None:
        """A bug or an unexpected Redis reply in a worker thread: stop with a failure status
        rather than hang. Entries not yet answered stay pending, for this worker's restart
        or another worker to claim."""
        log.exception("worker.thread_failed", thread=thread)
        self.failed = True
        self.stop()

    def stop(self) -> None:
        """Stop reading; what is held is answered until `shutdown_grace_s` has passed."""
        if not self.stopping.is_set():
            self._give_up_at = time.monotonic() + self.settings.shutdown_grace_s
        self.stopping.set()
        with self._lock:
            self._room.notify_all()
            self._work.notify_all()

    @property
    def runner(self) -> BatchRunner:
        """The first instance's runner: warm-up and calibration measure this one."""
        return self.runners[0]

    def set_merge_tokens(self, merge_tokens: int) -> None:
        """How much padding a merge of buckets may add (batching.py); warm-up measures it."""
        self.batcher.merge_tokens = merge_tokens
        metrics.MERGE_TOKENS.labels(self.name).set(merge_tokens)

    def load(self) -> tuple[int, list[int]]:
        """Entries held (read, not yet answered) and requests queued per bucket, for metrics."""
        with self._lock:
            return len(self._held), [len(bucket.items) for bucket in self.batcher.buckets]

    # --- reading ------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while not self.stopping.is_set():
                room = self._wait_for_room()
                if room:
                    self._admit(self._retry(self._next_entries, room))
        except ShutdownExpired:
            pass
        except Exception:
            self._fail("reader")
        finally:
            with self._lock:
                self._reading = False
                self._work.notify_all()

    def _wait_for_room(self) -> int:
        """Free in-flight slots. Own pending entries are drained one at a time (stream.py),
        each once everything held is answered, so a poison one crashes nothing else."""
        with self._lock:
            while self._is_full() and not self.stopping.is_set():
                self._room.wait(0.5)
            return self.settings.max_inflight - len(self._held)

    def _is_full(self) -> bool:
        if self.reader.draining_own_pending:  # one of them may be poison: each runs alone
            return bool(self._held)
        return len(self._held) >= self.settings.max_inflight

    def _next_entries(self, room: int) -> list[Entry]:
        """Idle entries of other consumers when a sweep is due, else our own and new ones."""
        if self.reclaimer.due() and not self.reader.draining_own_pending:
            claimed = self.reclaimer.claim(room)
            if claimed:
                return claimed
        return self.reader.read(min(room, self.settings.read_count), self.settings.block_ms)

    def _admit(self, entries: Sequence[Entry]) -> None:
        """Validate and prepare new entries, queue the good ones, answer the bad ones."""
        now, now_ms = time.monotonic(), int(time.time() * 1000)
        with self._lock:  # a redelivered entry we already hold is skipped, not run twice
            entries = [e for e in entries if e.id not in self._held]
        entries = self._retry(self.dead_letters.divert, entries)
        good: list[Pending] = []
        bad: list[Answer] = []
        unanswerable: list[str] = []
        for entry in entries:
            if entry.fields is None:
                unanswerable.append(entry.id)
                metrics.UNANSWERABLE.labels(self.name, "deleted").inc()
                continue
            try:
                request = protocol.parse_entry(entry.fields, self.settings.namespace,
                                               self.settings.max_payload_bytes)
            except InvalidEntry as exc:
                if exc.answerable:
                    assert exc.request_id is not None and exc.reply_to is not None
                    bad.append(Answer(entry.id, exc.reply_to, exc.content_type,
                                      protocol.error_envelope(exc.request_id,
                                                              ErrorCode.INVALID_REQUEST, str(exc)),
                                      entry_time_ms(entry.id)))
                else:
                    unanswerable.append(entry.id)
                    metrics.UNANSWERABLE.labels(self.name, "no_id").inc()
                    log.warning("entry.unanswerable", entry_id=entry.id, reason=str(exc))
                continue
            prepared = self._prepare(entry.id, request, now, now_ms)
            if isinstance(prepared, Pending):
                good.append(prepared)
            else:
                bad.append(prepared)
        if unanswerable:
            self._retry(self.replier.ack, unanswerable)
        with self._lock:
            self._held.update(p.entry_id for p in good)
            self._held.update(a.entry_id for a in bad)
            for pending in good:
                self.batcher.add(pending)
            self._work.notify_all()
        if bad:
            self._answers.put(bad)

    def _prepare(self, entry_id: str, request: Request, now: float,
                 now_ms: int) -> Pending | Answer:
        if request.deadline_ms is not None and request.deadline_ms <= now_ms:
            return error_answer(entry_id, request, ErrorCode.DEADLINE_EXCEEDED,
                                "deadline passed before the request was read")
        try:
            payload = protocol.decode(request.payload, request.content_type)
            item = self.model.prepare(payload, len(request.payload))
        except ValueError as exc:  # undecodable payload or InvalidInput
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST, str(exc))
        except Exception as exc:
            log.exception("model.prepare_failed", request_id=request.id)
            return error_answer(entry_id, request, ErrorCode.MODEL_ERROR,
                                f"preprocessing failed: {type(exc).__name__}: {exc}")
        return Pending(entry_id, request, item, now)

    # --- computing ----------------------------------------------------------------------------

    def _compute_thread(self, runner: BatchRunner) -> None:
        """One model instance's loop; a bug in it stops the worker with a failure status."""
        try:
            self._compute_loop(runner)
        except Exception:
            self._fail(threading.current_thread().name)

    def _compute_loop(self, runner: BatchRunner) -> None:
        """Double buffering: batch N+1 is staged (collated, copied) while batch N computes."""
        running: Job | None = None
        while True:
            if running is None:
                runner.release_if_fragmented()  # about to wait: a moment to tidy memory
            batch = self._next_batch(block=running is None)
            if batch is None and running is None:
                return
            upcoming = runner.stage(batch) if batch is not None else None
            if running is not None:
                self._answers.put(self._complete(runner, running))
            if upcoming is not None:
                runner.launch(upcoming)
            running = upcoming

    def _next_batch(self, block: bool = True) -> Batch | None:
        """The batch that is due, waiting for one if `block`. None once reading has stopped
        and nothing is left, or the shutdown grace has passed (what is left stays pending for
        others); not blocking, also None when no batch is due yet, or when another instance
        is idle: it can start the batch now, rather than after our current one."""
        with self._lock:
            while time.monotonic() < self._give_up_at:
                if not block and self._idle:
                    return None
                # Nothing more can arrive: don't wait for a batch to fill.
                flush = not self._reading or len(self._held) >= self.settings.max_inflight
                batch = self.batcher.next_batch(time.monotonic(), int(time.time() * 1000), flush)
                if batch is not None or not block:
                    return batch
                if not self._reading:
                    return None
                until_ready = self.batcher.seconds_until_ready(time.monotonic())
                self._idle += 1
                try:
                    self._work.wait(0.5 if until_ready is None else until_ready)
                finally:
                    self._idle -= 1
            return None

    def _complete(self, runner: BatchRunner, job: Job) -> list[Answer]:
        batch = job.batch
        answers = [error_answer(p.entry_id, p.request, ErrorCode.DEADLINE_EXCEEDED,
                                "deadline passed while queued") for p in batch.expired]
        if not batch.members:
            return answers
        try:
            results = runner.finish(job)
        except Exception as exc:
            log.exception("batch.failed", bucket=batch.bucket, size=len(batch.members))
            message = f"{type(exc).__name__}: {exc}"
            return answers + [error_answer(p.entry_id, p.request, ErrorCode.MODEL_ERROR, message)
                              for p in batch.members]
        compute_s, started_ms = job.compute_s, job.started_ms
        enqueued_ms = [entry_time_ms(p.entry_id) for p in batch.members]
        # Waits in whole µs: an integer division each, where round(x, 3) cost more than the
        # rest of the answer (and the XADD time is whole ms anyway).
        started_us = round(started_ms * 1000)
        queue_ms = [max(0, started_us - enqueued * 1000) / 1000 for enqueued in enqueued_ms]
        self._observe(batch, compute_s, queue_ms)
        meta = {"model": self.name, "batch_size": len(batch.members),
                "compute_ms": round(compute_s * 1000, 3), "worker": self.settings.consumer,
                "bucket": batch.bucket, "padded_length": batch.longest}
        for pending, result, enqueued, waited_ms in zip(batch.members, results, enqueued_ms,
                                                         queue_ms, strict=True):
            request = pending.request
            if isinstance(result, TooLarge):
                answers.append(error_answer(pending.entry_id, request, ErrorCode.TOO_LARGE,
                                            result.message))
                continue
            answers.append(Answer(pending.entry_id, request.reply_to, request.content_type,
                                  protocol.success_envelope(request.id, result, {
                                      **meta, "queue_ms": waited_ms}), enqueued))
        return answers

    def _observe(self, batch: Batch, compute_s: float, queue_ms: list[float]) -> None:
        bucket = str(batch.bucket)
        real, padded = batch.real_tokens, batch.padded_tokens
        metrics.BATCH_SIZE.labels(self.name, bucket).observe(len(batch.members))
        metrics.PADDED_TOKENS.labels(self.name, bucket).observe(padded)
        metrics.PADDING_EFFICIENCY.labels(self.name).observe(real / padded if padded else 1.0)
        metrics.REAL_TOKENS_TOTAL.labels(self.name).inc(real)
        metrics.PADDED_TOKENS_TOTAL.labels(self.name).inc(padded)
        metrics.COMPUTE_TIME.labels(self.name).observe(compute_s)
        metrics.observe_all(metrics.QUEUE_WAIT.labels(self.name), [ms / 1000 for ms in queue_ms])
        log.debug("batch.done", bucket=batch.bucket, size=len(batch.members), longest=batch.longest,
                  padding_efficiency=round(real / padded, 3) if padded else 1.0,
                  compute_ms=round(compute_s * 1000, 2))

    # --- replying -----------------------------------------------------------------------------

    def _reply_loop(self) -> None:
        try:
            self._write_replies()
        except ShutdownExpired:
            log.warning("worker.grace_expired", left_pending=len(self._held))
        except Exception:
            self._fail("replier")

    def _write_replies(self) -> None:
        while (answers := self._next_answers()) is not None:
            replies = [self._encode(answer) for answer in answers]
            dropped = set(self._retry(self.replier.send, replies))
            if dropped:
                metrics.DROPPED_REPLIES.labels(self.name).inc(len(dropped))
                log.warning("replies.dropped_not_owner", count=len(dropped))
            written_ms = time.time() * 1000
            # dropped ones were answered by the consumer that claimed them
            answered = [a for a in answers if a.entry_id not in dropped]
            for status, count in Counter(a.status for a in answered).items():
                metrics.REQUESTS.labels(self.name, status).inc(count)  # labels() takes a lock
            metrics.observe_all(metrics.END_TO_END.labels(self.name), [
                max(0.0, written_ms - a.enqueued_ms) / 1000 for a in answered])
            with self._lock:  # dropped ones are freed too: they are no longer ours
                self._held.difference_update(a.entry_id for a in answers)
                self._room.notify_all()

    def _next_answers(self) -> list[Answer] | None:
        """The next answers to write, coalescing what is queued into one script call."""
        answers = self._answers.get()
        if answers is None:
            return None
        while len(answers) < MAX_REPLIES_PER_CALL:
            try:
                more = self._answers.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._answers.put(None)  # keep the end marker for the next call
                break
            answers = answers + more
        return answers

    def _encode(self, answer: Answer) -> Reply:
        try:
            data = protocol.encode(answer.envelope, answer.content_type)
        except Exception as exc:  # an unserialisable result: the reply thread must live on
            log.error("reply.unserialisable", request_id=answer.envelope["id"], error=str(exc))
            answer.envelope = protocol.error_envelope(
                answer.envelope["id"], ErrorCode.INTERNAL, f"result could not be encoded: {exc}")
            data = protocol.encode(answer.envelope, answer.content_type)
        return Reply(answer.entry_id, answer.reply_to, data)

    # --- Redis faults -------------------------------------------------------------------------

    def _retry(self, operation: Callable[..., T], *args: Any) -> T:
        """Run a Redis operation, retrying transient faults with backoff until it succeeds,
        or until the shutdown grace has passed (ShutdownExpired)."""
        delays = backoff_delays()
        while True:
            try:
                return operation(*args)
            except redis.RedisError as exc:
                if not is_transient(exc):
                    raise
                left = self._give_up_at - time.monotonic()
                if left <= 0:
                    raise ShutdownExpired from exc
                delay = min(next(delays), left)
                log.warning("redis.unavailable", error=str(exc), retry_in_s=round(delay, 3))
                self.reader.draining_own_pending = True  # a lost reply may have delivered entries
                time.sleep(delay)
