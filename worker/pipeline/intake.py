"""The intake thread: read or claim entries, divert poison, parse, prepare, queue.

It runs in the `redbatch-reader` thread; each read's decoding, preparing (tokenising) and
queueing run on the prepare stage's thread (prepare_stage.py), overlapping the next read.
It never runs the model's forward pass: good entries become Pending requests in the
batcher, bad ones (and those refused at read time, predicted to miss their deadline or the
target) are answered at once, written in one reply-and-ack call per read
(reply.ReadTimeAnswers), not queued behind the results. Its Redis calls are the reads and
claims, the id claims, the dead-letter diversion, that write, and the XACK of entries that
cannot be answered at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from producer import protocol, request_entry
from producer.entry_rules import EntryRules
from producer.protocol import ErrorCode
from producer.request_entry import InvalidEntry, Request
from worker.models.base import InvalidInput, Model, Prepared
from worker.observe import metrics
from worker.pipeline import ports
from worker.pipeline.answers import Answer, AnswerQueue, error_answer, refused_answer
from worker.pipeline.generative_envelopes import routed_error
from worker.pipeline.inflight import InFlight
from worker.pipeline.prepare_stage import PrepareStage
from worker.pipeline.reply import ReadTimeAnswers
from worker.pipeline.retry import RedisRetry
from worker.policy.batching import Batcher, Pending
from worker.policy.flow import arrival_ms, claims_first, is_past_deadline
from worker.policy.targeted import TargetedDispatch
from worker.streams.id_claims import Claim, IdClaims
from worker.streams.reader import Entry

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
    reply_prefixes: tuple[str, ...] = ()  # where a reply_to may point besides the defaults
    prepare_thread: bool = True  # tokenise on the prepare stage's thread (prepare_stage.py)


class Intake:
    def __init__(self, config: IntakeConfig, model: Model, reader: ports.Reader,
                 reclaimer: ports.Reclaims, dead_letters: ports.DeadLetters, replier: ports.Replies,
                 batcher: Batcher, inflight: InFlight, answers: AnswerQueue,
                 retry: RedisRetry, targeted: TargetedDispatch, ids: IdClaims) -> None:
        """`targeted`: predicts, at read time, whether a request can still be served in time;
        `ids`: refuses an entry whose id another entry serves on the same reply key."""
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
        self.ids = ids
        self.rules = EntryRules(config.namespace, config.max_payload_bytes,
                                         config.reply_prefixes)
        self.read_time = ReadTimeAnswers(config.model_name, replier, inflight, answers, retry)
        self.stage = PrepareStage(threaded=config.prepare_thread)

    def run(self, stopping: threading.Event) -> None:
        """Read until stopping; then tell the compute loops nothing more will come (what
        a sharded reader's threads read meanwhile is admitted first, and answered)."""
        try:
            try:
                while not stopping.is_set():
                    room = self.inflight.wait_for_room(self.reader.draining_own_pending,
                                                       stopping)
                    if room:
                        self.admit(self.retry(self.next_entries, room))
                left = self.reader.close()
                if left:
                    self.admit(left)
            finally:
                self.stage.drain()  # all that was read is queued before reading stops
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
        """Parse new entries and claim their ids here; hand them, held from now on, to the
        prepare stage, which decodes, tokenises and queues them (or answers them)."""
        entries = self.retry(self.dead_letters.divert, self.inflight.not_held(entries))
        admission = Admission()
        parsed = self.parse_all(entries, admission)
        with self.inflight.lock:
            self.inflight.held.update(entry.id for entry, _ in parsed)
            self.inflight.held.update(a.entry_id for a in admission.bad)
        self.stage.submit(self.settle, admission, parsed, time.monotonic(),
                          int(time.time() * 1000))

    def settle(self, admission: Admission, parsed: Sequence[tuple[Entry, Request]],
               now: float, now_ms: int) -> None:
        """On the prepare stage: prepare the parsed requests, queue the good ones, answer
        the bad ones (one reply-and-ack call), ack those that cannot be answered."""
        self.prepare_into(admission, parsed, now, now_ms)
        if admission.unanswerable:
            self.retry(self.replier.ack, admission.unanswerable)
        now_ms = int(time.time() * 1000)
        with self.inflight.lock:
            for pending in admission.good:
                self._queue_or_refuse(pending, now_ms, admission.bad)
            self.inflight.work.notify_all()
        if admission.bad:
            self.read_time.write(admission.bad)

    def _queue_or_refuse(self, pending: Pending, now_ms: int, refused: list[Answer]) -> None:
        """With the lock held: queue the request, unless it is predicted to miss its
        deadline (or the target, when shedding): then it is answered now, not after a wait.
        Its arrival is read once, here (flow.arrival_ms)."""
        pending.enqueued_ms = arrival_ms(pending.entry_id, now_ms)
        if self.targeted.checks(pending):
            decision = self.targeted.admit(self.batcher, pending, now_ms)
            if not decision.admit:
                metrics.REFUSED.labels(self.config.model_name, decision.code).inc()
                refused.append(refused_answer(pending, decision))
                return
        self.batcher.add(pending)

    def parse_all(self, entries: Sequence[Entry],
                  admission: Admission) -> list[tuple[Entry, Request]]:
        """Every entry's request, its id claimed (one Redis call); those malformed, deleted
        or with an id another entry serves are put in `admission` instead."""
        parsed = [(entry, request) for entry in entries
                  if (request := self._parse(entry, admission)) is not None]
        taken = self.retry(self.ids.taken, [Claim(e.id, r.id, r.reply_to) for e, r in parsed])
        admission.bad += [self._duplicate(e.id, r) for e, r in parsed if e.id in taken]
        return [(entry, request) for entry, request in parsed if entry.id not in taken]

    def prepare_into(self, admission: Admission, parsed: Sequence[tuple[Entry, Request]],
                     now: float, now_ms: int) -> None:
        """Decode and prepare the parsed requests (one model call for the read)."""
        for (entry, _), prepared in zip(parsed, self.prepare_all(parsed, now, now_ms),
                                        strict=True):
            if isinstance(prepared, Pending):
                # A redelivered generative request may have streamed tokens already: the
                # engine resumes it from its reply stream instead of starting again.
                if entry.redelivered and self.model.generative:
                    prepared.item.data = replace(prepared.item.data, redelivered=True)
                admission.good.append(prepared)
            else:
                admission.bad.append(prepared)

    def _parse(self, entry: Entry, admission: Admission) -> Request | None:
        """The entry's request, or None once it is answered (malformed) or acked (deleted)."""
        if entry.fields is None:
            admission.unanswerable.append(entry.id)
            metrics.UNANSWERABLE.labels(self.config.model_name, "deleted").inc()
            return None
        try:
            return request_entry.parse_entry(entry.fields, self.config.namespace,
                                             self.config.max_payload_bytes,
                                             reply_prefixes=self.config.reply_prefixes,
                                             default_reply=entry.default_reply)
        except InvalidEntry as exc:
            self._refuse(entry.id, exc, admission)
            return None

    def _duplicate(self, entry_id: str, request: Request) -> Answer:
        """Another entry with this id serves the same reply key: this one is refused."""
        metrics.REFUSED.labels(self.config.model_name, ErrorCode.DUPLICATE_ID.value).inc()
        log.warning("entry.duplicate_id", entry_id=entry_id, request_id=request.id)
        return self._routed(error_answer(
            entry_id, request, ErrorCode.DUPLICATE_ID, f"request id {request.id!r} is already "
            "in flight on this reply key: choose a unique id per request", field="id"), request)

    def _refuse(self, entry_id: str, exc: InvalidEntry, admission: Admission) -> None:
        """A malformed entry: answered `invalid_request` when it names whom to answer."""
        if not exc.answerable:
            admission.unanswerable.append(entry_id)
            metrics.UNANSWERABLE.labels(self.config.model_name, "no_id").inc()
            log.warning("entry.unanswerable", entry_id=entry_id, reason=str(exc))
            return
        assert exc.request_id is not None and exc.reply_to is not None
        request = Request(exc.request_id, exc.payload or b"", exc.content_type, exc.reply_to,
                          default_reply=exc.default_reply or exc.reply_to)
        admission.bad.append(self._routed(error_answer(
            entry_id, request, ErrorCode.INVALID_REQUEST, str(exc), **exc.details), request))

    def prepare_all(self, parsed: Sequence[tuple[Entry, Request]], now: float,
                    now_ms: int) -> list[Pending | Answer]:
        """Decode each request, then preprocess the read's payloads in one model call
        (`prepare_many`: a batch tokeniser); each bad one becomes its own error answer,
        routed where its reader waits (_routed)."""
        decoded = [self._decode(entry.id, request, now_ms) for entry, request in parsed]
        at = [n for n, payload in enumerate(decoded) if not isinstance(payload, Answer)]
        items = self._prepare_many([(decoded[n], len(parsed[n][1].payload)) for n in at])
        results: list[Pending | Answer] = decoded  # the decoded payloads are replaced below
        for n, item in zip(at, items, strict=True):
            entry, request = parsed[n]
            results[n] = self._pending(entry.id, request, item, now)
        return [self._routed(result, request) if isinstance(result, Answer) else result
                for result, (_, request) in zip(results, parsed, strict=True)]

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

    def _routed(self, answer: Answer, request: Request) -> Answer:
        """An error answer where the request's reader waits: a generative request's reply
        stream unless it asked for none; the default key when its `reply_to` is of the
        other kind (a list where a stream is wanted, or the reverse)."""
        streamed = self.model.generative and self.model.answers_on_stream(_decoded(request))
        if request_entry.misdirected(request, streamed, self.rules):
            request = replace(request, reply_to=request.default_reply)
            answer = replace(answer, reply_to=request.default_reply)
        if self.model.generative:
            return routed_error(answer, request, self.config.namespace, streamed)
        return answer

    def _decode(self, entry_id: str, request: Request, now_ms: int) -> Any:
        """The decoded payload, or the error answer that replaces the request (its
        deadline passed, its payload is undecodable, its reply_to of the wrong kind)."""
        if is_past_deadline(request.deadline_ms, now_ms):
            return error_answer(entry_id, request, ErrorCode.DEADLINE_EXCEEDED,
                                "deadline passed before the request was read")
        try:
            payload = protocol.decode(request.payload, request.content_type)
        except ValueError as exc:  # an undecodable payload
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST, str(exc))
        streamed = self.model.generative and self.model.answers_on_stream(payload)
        if request_entry.misdirected(request, streamed, self.rules):
            return error_answer(entry_id, request, ErrorCode.INVALID_REQUEST,
                                self.rules.misdirected_message(streamed), field="reply_to")
        return payload

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
