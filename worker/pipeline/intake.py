"""The intake thread: read or claim entries, divert poison, parse, prepare, queue.

It runs in the `redbatch-reader` thread. It never runs the model's forward pass: good
entries become Pending requests in the batcher, bad ones (and those refused at read time,
predicted to miss their deadline or the target) are answered at once, written by this
thread in one reply-and-ack call per read (reply.ReadTimeAnswers), not queued behind the
results. Its Redis calls are the reads and claims, the dead-letter diversion, that write,
and the XACK of entries that cannot be answered at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from producer import protocol
from producer.protocol import ErrorCode, InvalidEntry, Request
from worker.models.base import InvalidInput, Model, Prepared
from worker.observe import metrics
from worker.pipeline.answers import Answer, AnswerQueue, error_answer, refused_answer
from worker.pipeline.inflight import InFlight
from worker.pipeline.reply import ReadTimeAnswers
from worker.pipeline.retry import RedisRetry
from worker.pipeline.token_answers import routed_error
from worker.policy.batching import Batcher, Pending
from worker.policy.flow import claims_first, entry_time_ms, is_past_deadline
from worker.policy.targeted import TargetedDispatch
from worker.streams.reader import Entry
from worker.streams.sharding import AnyDeadLetters, AnyReader, AnyReclaimer, AnyReplier

log = structlog.get_logger("redbatch.worker")


@dataclass(slots=True)
class Admission:
    """What the intake makes of the entries of one read."""

    good: list[Pending] = field(default_factory=list)
    bad: list[Answer] = field(default_factory=list)  # answered with an error, no compute
    unanswerable: list[str] = field(default_factory=list)  # no id to answer: acked only


@dataclass(frozen=True, slots=True)
class IntakeConfig:
    model_name: str
    namespace: str
    max_payload_bytes: int
    block_ms: int


class Intake:
    def __init__(self, config: IntakeConfig, model: Model, reader: AnyReader,
                 reclaimer: AnyReclaimer, dead_letters: AnyDeadLetters, replier: AnyReplier,
                 batcher: Batcher, inflight: InFlight, answers: AnswerQueue,
                 retry: RedisRetry, targeted: TargetedDispatch) -> None:
        """`targeted`: predicts, at read time, whether a request can still be served in time."""
        self.config = config
        self.model = model
        self.reader = reader
        self.reclaimer = reclaimer
        self.dead_letters = dead_letters
        self.replier = replier
        self.batcher = batcher
        self.inflight = inflight
        self.answers = answers
        self.retry = retry
        self.targeted = targeted
        self.read_time = ReadTimeAnswers(config.model_name, replier, inflight, answers, retry)

    def run(self, stopping: threading.Event) -> None:
        """Read until stopping; then tell the compute loops nothing more will come (what
        a sharded reader's threads read meanwhile is admitted first, and answered)."""
        try:
            while not stopping.is_set():
                room = self.inflight.wait_for_room(self.reader.draining_own_pending, stopping)
                if room:
                    self.admit(self.retry(self.next_entries, room))
            left = self.reader.close()
            if left:
                self.admit(left)
        finally:
            self.inflight.stop_reading()

    def next_entries(self, room: int) -> list[Entry]:
        """Idle entries of other consumers when a sweep is due, else our own and new ones."""
        if claims_first(self.reclaimer.due(), self.reader.draining_own_pending):
            claimed = self.reclaimer.claim(room)
            if claimed:
                return claimed
        return self.reader.read(self.inflight.policy.read_size(room), self.config.block_ms)

    def admit(self, entries: Sequence[Entry]) -> None:
        """Classify new entries, queue the good ones, answer the bad ones."""
        entries = self.retry(self.dead_letters.divert, self.inflight.not_held(entries))
        admission = self.classify(entries, time.monotonic(), int(time.time() * 1000))
        if admission.unanswerable:
            self.retry(self.replier.ack, admission.unanswerable)
        now_ms = int(time.time() * 1000)
        with self.inflight.lock:
            self.inflight.held.update(p.entry_id for p in admission.good)
            self.inflight.held.update(a.entry_id for a in admission.bad)
            for pending in admission.good:
                self._queue_or_refuse(pending, now_ms, admission.bad)
            self.inflight.work.notify_all()
        if admission.bad:
            self.read_time.write(admission.bad)

    def _queue_or_refuse(self, pending: Pending, now_ms: int, refused: list[Answer]) -> None:
        """With the lock held: queue the request, unless it is predicted to miss its
        deadline (or the target, when shedding): then it is answered now, not after a wait."""
        if self.targeted.checks(pending):
            decision = self.targeted.admit(self.batcher, pending, now_ms)
            if not decision.admit:
                metrics.REFUSED.labels(self.config.model_name, decision.code).inc()
                refused.append(refused_answer(pending, decision))
                return
        self.batcher.add(pending)

    def classify(self, entries: Sequence[Entry], now: float, now_ms: int) -> Admission:
        admission = Admission()
        parsed: list[tuple[Entry, Request]] = []
        for entry in entries:
            if entry.fields is None:
                admission.unanswerable.append(entry.id)
                metrics.UNANSWERABLE.labels(self.config.model_name, "deleted").inc()
                continue
            try:
                request = protocol.parse_entry(entry.fields, self.config.namespace,
                                               self.config.max_payload_bytes)
            except InvalidEntry as exc:
                self._refuse(entry.id, exc, admission)
                continue
            parsed.append((entry, request))
        for (entry, _), prepared in zip(parsed, self.prepare_all(parsed, now, now_ms),
                                        strict=True):
            if isinstance(prepared, Pending):
                if entry.redelivered and self.model.generative:  # it may have begun
                    prepared.item.data = replace(prepared.item.data, redelivered=True)
                admission.good.append(prepared)
            else:
                admission.bad.append(prepared)
        return admission

    def _refuse(self, entry_id: str, exc: InvalidEntry, admission: Admission) -> None:
        """A malformed entry: answered `invalid_request` when it names whom to answer."""
        if not exc.answerable:
            admission.unanswerable.append(entry_id)
            metrics.UNANSWERABLE.labels(self.config.model_name, "no_id").inc()
            log.warning("entry.unanswerable", entry_id=entry_id, reason=str(exc))
            return
        assert exc.request_id is not None and exc.reply_to is not None
        answer = Answer(entry_id, exc.reply_to, exc.content_type,
                        protocol.error_envelope(exc.request_id, ErrorCode.INVALID_REQUEST,
                                                str(exc), **exc.details),
                        entry_time_ms(entry_id))
        if self.model.generative:  # on its reply stream, where its reader waits
            request = Request(exc.request_id, exc.payload or b"", exc.content_type,
                              exc.reply_to)
            answer = routed_error(answer, request, self.config.namespace,
                                  self.model.answers_on_stream(_decoded(request)))
        admission.bad.append(answer)

    def prepare_all(self, parsed: Sequence[tuple[Entry, Request]], now: float,
                    now_ms: int) -> list[Pending | Answer]:
        """Decode each request, then preprocess the read's payloads in one model call
        (`prepare_many`: a batch tokeniser); each bad one becomes its own error answer (for
        a generative model, on the request's reply stream unless it asked for none)."""
        decoded = [self._decode(entry.id, request, now_ms) for entry, request in parsed]
        at = [n for n, payload in enumerate(decoded) if not isinstance(payload, Answer)]
        items = self._prepare_many([(decoded[n], len(parsed[n][1].payload)) for n in at])
        results: list[Pending | Answer] = decoded  # the decoded payloads are replaced below
        for n, item in zip(at, items, strict=True):
            entry, request = parsed[n]
            results[n] = self._pending(entry.id, request, item, now)
        if self.model.generative:
            return [self._routed(answer, request) for answer, (_, request)
                    in zip(results, parsed, strict=True)]
        return results

    def _prepare_many(self, payloads: list[tuple[Any, int]]) -> list[Prepared | Exception]:
        """The model's items for a read; should its batch call fail as a whole, one call
        per payload, so only the payloads at fault are refused."""
        if not payloads:
            return []
        try:
            items = self.model.prepare_many(payloads)
            if len(items) != len(payloads):
                raise RuntimeError(f"prepare_many returned {len(items)} items "
                                   f"for {len(payloads)} payloads")
            return items
        except Exception:
            log.exception("model.prepare_many_failed", payloads=len(payloads))
            return [item for one in payloads for item in Model.prepare_many(self.model, [one])]

    def _routed(self, prepared: Pending | Answer, request: Request) -> Pending | Answer:
        if isinstance(prepared, Answer):
            return routed_error(prepared, request, self.config.namespace,
                                self.model.answers_on_stream(_decoded(request)))
        return prepared

    def _decode(self, entry_id: str, request: Request, now_ms: int) -> Any:
        """The decoded payload, or the error answer that replaces the request."""
        if is_past_deadline(request.deadline_ms, now_ms):
            return error_answer(entry_id, request, ErrorCode.DEADLINE_EXCEEDED,
                                "deadline passed before the request was read")
        try:
            return protocol.decode(request.payload, request.content_type)
        except ValueError as exc:  # an undecodable payload
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST, str(exc))

    def _pending(self, entry_id: str, request: Request, item: Prepared | Exception,
                 now: float) -> Pending | Answer:
        """The request queued with its model item, or its error answer."""
        if isinstance(item, InvalidInput):
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST, str(item),
                                **item.details)
        if isinstance(item, ValueError):
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST, str(item))
        if isinstance(item, Exception):
            log.error("model.prepare_failed", request_id=request.id, exc_info=item)
            return error_answer(entry_id, request, ErrorCode.MODEL_ERROR,
                                f"preprocessing failed: {type(item).__name__}: {item}")
        return Pending(entry_id, request, item, now)


def _decoded(request: Request) -> Any:
    """The payload, or None when it cannot be decoded (only for routing an error)."""
    try:
        return protocol.decode(request.payload, request.content_type)
    except ValueError:
        return None
