"""Answers: the envelope for each request, built by the intake and the compute loops and
queued for the reply thread, which coalesces what is queued into one script call."""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer import protocol
from producer.protocol import ErrorCode
from producer.request_entry import Request
from worker.execution.guarded_runner import TooLarge
from worker.policy.batching import Batch, Pending
from worker.policy.flow import arrival_ms
from worker.policy.latency import Admission

MAX_REPLIES_PER_CALL = 1024


@dataclass(slots=True)
class Answer:
    """An envelope waiting to be encoded and written."""

    entry_id: str
    reply_to: str
    content_type: str
    envelope: dict[str, Any]
    enqueued_ms: int  # the XADD time, read from the entry id once per request
    stream_index: int = 0  # above 0: the `done` entry <index>-1 of a reply stream (generative)
    background: bool = False  # a batch job's line: not held to the latency target

    @property
    def status(self) -> str:
        return "ok" if self.envelope["ok"] else self.envelope["error"]["code"]


def error_answer(entry_id: str, request: Request, code: ErrorCode, message: str,
                 **details: Any) -> Answer:
    return Answer(entry_id, request.reply_to, request.content_type,
                  protocol.error_envelope(request.id, code, message, **details),
                  arrival_ms(entry_id, time.time() * 1000), background=request.background)


def refused_answer(pending: Pending, admission: Admission) -> Answer:
    """A request answered at read time: it is predicted to miss its deadline (or, when
    shedding, the latency target)."""
    predicted = f"predicted to finish in {admission.predicted_ms:.0f} ms"
    if admission.code == ErrorCode.OVERLOADED:
        return error_answer(pending.entry_id, pending.request, ErrorCode.OVERLOADED,
                            f"over the latency target: {admission.waited_ms:.0f} ms since "
                            f"the XADD, {predicted} and a safety margin of "
                            f"{admission.margin_ms:.0f} ms kept below the target",
                            retry_after_ms=admission.retry_after_ms)
    return error_answer(pending.entry_id, pending.request, ErrorCode.DEADLINE_EXCEEDED,
                        f"cannot meet its deadline: {predicted}")


def expired_answers(expired: Sequence[Pending]) -> list[Answer]:
    return [error_answer(p.entry_id, p.request, ErrorCode.DEADLINE_EXCEEDED,
                         "deadline passed while queued") for p in expired]


def overloaded_answers(refused: Sequence[Pending], retry_after_ms: int) -> list[Answer]:
    """Requests the cork baseline refused at dispatch: predicted to miss its target."""
    return [error_answer(p.entry_id, p.request, ErrorCode.OVERLOADED,
                         "over the latency target at dispatch (batch_controller cork)",
                         retry_after_ms=retry_after_ms) for p in refused]


def failed_answers(members: Sequence[Pending], exc: Exception) -> list[Answer]:
    """The model raised for the whole batch: every member gets the error."""
    message = f"{type(exc).__name__}: {exc}"
    return [error_answer(p.entry_id, p.request, ErrorCode.MODEL_ERROR, message)
            for p in members]


def result_answers(batch: Batch, results: Sequence[Any], meta: dict[str, Any],
                   enqueued_ms: Sequence[int], queue_ms: Sequence[float]) -> list[Answer]:
    """One answer per member: its result with the batch's meta and its own queue wait, or
    `too_large` for an input that ran out of memory alone."""
    answers = []
    for pending, result, enqueued, waited_ms in zip(batch.members, results, enqueued_ms,
                                                     queue_ms, strict=True):
        request = pending.request
        if isinstance(result, TooLarge):
            answers.append(error_answer(pending.entry_id, request, ErrorCode.TOO_LARGE,
                                        result.message))
            continue
        answers.append(Answer(pending.entry_id, request.reply_to, request.content_type,
                              protocol.success_envelope(request.id, result, {
                                  **meta, "queue_ms": waited_ms}), enqueued,
                              background=request.background))
    return answers


class AnswerQueue:
    """Answers on their way to the reply thread; None is the end marker."""

    def __init__(self) -> None:
        self._queue: queue.Queue[list[Answer] | None] = queue.Queue()

    def put(self, answers: list[Answer]) -> None:
        self._queue.put(answers)

    def close(self) -> None:
        self._queue.put(None)

    def next(self) -> list[Answer] | None:
        """The next answers to write, coalescing what is queued; None once closed."""
        answers = self._queue.get()
        if answers is None:
            return None
        while len(answers) < MAX_REPLIES_PER_CALL:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._queue.put(None)  # keep the end marker for the next call
                break
            answers = answers + more
        return answers
