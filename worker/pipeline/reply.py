"""The reply thread: encode answers, write each with the XACK of its entry, free slots.

It runs in the `redbatch-replier` thread. It never reads the request stream and never runs
the model: it takes answers from the queue, and its one Redis call per round is the
replier's ownership-checked reply-and-ack script.
"""

from __future__ import annotations

import time
from collections import Counter

import structlog

from producer import protocol
from producer.protocol import ErrorCode
from worker.observe import metrics
from worker.pipeline.answers import Answer, AnswerQueue
from worker.pipeline.inflight import InFlight
from worker.pipeline.retry import RedisRetry
from worker.policy.flow import end_to_end_s
from worker.streams.replier import Replier, Reply

log = structlog.get_logger("redbatch.worker")


class ReplyWriter:
    def __init__(self, model_name: str, replier: Replier, inflight: InFlight,
                 answers: AnswerQueue, retry: RedisRetry) -> None:
        self.model_name = model_name
        self.replier = replier
        self.inflight = inflight
        self.answers = answers
        self.retry = retry

    def run(self) -> None:
        """Write until the answer queue is closed."""
        while (answers := self.answers.next()) is not None:
            self.write(answers)

    def write(self, answers: list[Answer]) -> None:
        replies = [encode(answer) for answer in answers]
        dropped = set(self.retry(self.replier.send, replies))
        if dropped:
            metrics.DROPPED_REPLIES.labels(self.model_name).inc(len(dropped))
            log.warning("replies.dropped_not_owner", count=len(dropped))
        written_ms = time.time() * 1000
        # dropped ones were answered by the consumer that claimed them
        answered = [a for a in answers if a.entry_id not in dropped]
        for status, count in Counter(a.status for a in answered).items():
            metrics.REQUESTS.labels(self.model_name, status).inc(count)  # labels() takes a lock
        metrics.observe_all(metrics.END_TO_END.labels(self.model_name),
                            end_to_end_s(written_ms, [a.enqueued_ms for a in answered]))
        # dropped ones are freed too: they are no longer ours
        self.inflight.release(a.entry_id for a in answers)


def encode(answer: Answer) -> Reply:
    """The envelope in the request's content type; an unserialisable result becomes an
    `internal` error, so the reply thread lives on and the request is still answered."""
    try:
        data = protocol.encode(answer.envelope, answer.content_type)
    except Exception as exc:
        log.error("reply.unserialisable", request_id=answer.envelope["id"], error=str(exc))
        answer.envelope = protocol.error_envelope(
            answer.envelope["id"], ErrorCode.INTERNAL, f"result could not be encoded: {exc}")
        data = protocol.encode(answer.envelope, answer.content_type)
    return Reply(answer.entry_id, answer.reply_to, data)
