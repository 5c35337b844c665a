"""The reply thread: encode answers, write each with the XACK of its entry, free slots.

It runs in the `redbatch-replier` thread. It never reads the request stream and never runs
the model: it takes answers from the queue, and its one Redis call per round is the
replier's ownership-checked reply-and-ack script. Answers decided at read time (refusals,
invalid entries) are written by the intake itself (ReadTimeAnswers), with the same script,
so that they do not wait behind the results queued for this thread. On a Redis Cluster,
answers for a shard whose master fails (a failover) are held back and sent again after a
backoff (a timer puts an empty round on the queue), so the other shards' replies do not
wait for that master.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import structlog

from producer import protocol
from producer.protocol import ErrorCode
from worker.observe import metrics
from worker.pipeline import ports
from worker.pipeline.answers import Answer, AnswerQueue
from worker.pipeline.encoding import encode_envelope
from worker.pipeline.inflight import InFlight
from worker.pipeline.retry import RedisRetry, ShutdownExpired
from worker.policy.flow import end_to_end_s
from worker.policy.latency import LatencyPolicy
from worker.streams.replier import Reply
from worker.streams.token_streams import Chunk, FinalChunk

log = structlog.get_logger("redbatch.worker")


class ReplyWriter:
    def __init__(self, model_name: str, replier: ports.Replies, inflight: InFlight,
                 answers: AnswerQueue, retry: RedisRetry,
                 latency: LatencyPolicy | None = None,
                 streams: ports.TokenStreams | None = None) -> None:
        """`latency`: with a latency target, told each answer's end-to-end time.
        `streams`: a generative model's reply streams, for answers with a stream_index."""
        self.model_name = model_name
        self.replier = replier
        self.inflight = inflight
        self.answers = answers
        self.retry = retry
        self.latency = latency
        self.streams = streams
        self.deferred: list[Answer] = []  # a cluster shard's answers, while its master fails

    def run(self) -> None:
        """Write until the answer queue is closed (then what a failing shard held back)."""
        while (answers := self.answers.next()) is not None:
            self.write(answers)
        while self.deferred:
            if self.retry.grace.left() <= 0:
                raise ShutdownExpired
            time.sleep(self.replier.next_retry_s())
            self.write([])

    def write(self, answers: list[Answer]) -> None:
        answers, self.deferred = self.deferred + answers, []
        replies = [encode(answer) for answer in answers]
        pairs = list(zip(answers, replies, strict=True))
        dropped, deferred = self._send([r for a, r in pairs if not a.stream_index])
        if deferred:
            self._defer([a for a in answers if a.entry_id in deferred])
            answers = [a for a in answers if a.entry_id not in deferred]
        finals = [FinalChunk(r.entry_id, Chunk(r.reply_key, a.stream_index, r.envelope))
                  for a, r in pairs if a.stream_index]
        if finals:
            assert self.streams is not None
            dropped.update(self.retry(self.streams.finish, finals))
        if dropped:
            metrics.DROPPED_REPLIES.labels(self.model_name).inc(len(dropped))
            log.warning("replies.dropped_not_owner", count=len(dropped))
        written_ms = time.time() * 1000
        # dropped ones were answered by the consumer that claimed them
        answered = [a for a in answers if a.entry_id not in dropped]
        latencies_s = count_written(self.model_name, answered, written_ms)
        if self.latency is not None:
            self._observe_latency(written_ms, answered, latencies_s)
        # dropped ones are freed too: they are no longer ours
        self.inflight.release(a.entry_id for a in answers)

    def _send(self, replies: list[Reply]) -> tuple[set[str], set[str]]:
        """(dropped, deferred) entry ids; only a sharded replier defers."""
        if self.replier.defers:
            dropped, deferred = self.retry(self.replier.send_available, replies)
            return set(dropped), set(deferred)
        return set(self.retry(self.replier.send, replies)), set()

    def _defer(self, answers: list[Answer]) -> None:
        """Hold these answers (still in flight) and wake the thread when they are due."""
        self.deferred = answers
        timer = threading.Timer(self.replier.next_retry_s(), self.answers.put, args=([],))
        timer.daemon = True
        timer.start()

    def _observe_latency(self, written_ms: float, answered: list[Answer],
                         latencies_s: list[float]) -> None:
        """Served online answers steer the safety margin."""
        assert self.latency is not None
        served = served_online_ms(answered, latencies_s)
        with self.inflight.lock:
            self.latency.answered(written_ms, served)
            observed = self.latency.margin.observed.value(0.0)
            margin = self.latency.margin.ms
        metrics.LATENCY_OBSERVED.labels(self.model_name).set(observed / 1000)
        metrics.LATENCY_MARGIN.labels(self.model_name).set(margin / 1000)


class ReadTimeAnswers:
    """Answers decided when their entries are read (refusals, deadlines already passed,
    invalid entries), written by the intake thread itself in one ownership-checked
    reply-and-ack call per read: queued for the reply thread, they waited behind the
    results being written. On a Redis Cluster (the sharded replier defers a failing
    shard's answers, state only the reply thread keeps) and for a generative model's
    reply streams they still go through the reply thread."""

    def __init__(self, model_name: str, replier: ports.Replies, inflight: InFlight,
                 answers: AnswerQueue, retry: RedisRetry) -> None:
        self.model_name = model_name
        self.replier = replier
        self.inflight = inflight
        self.answers = answers
        self.retry = retry

    def write(self, answers: list[Answer]) -> None:
        direct = not self.replier.defers
        now = [a for a in answers if direct and not a.stream_index]
        later = [a for a in answers if not direct or a.stream_index]
        if later:
            self.answers.put(later)
        if not now:
            return
        dropped = set(self.retry(self.replier.send, [encode(a) for a in now]))
        if dropped:
            metrics.DROPPED_REPLIES.labels(self.model_name).inc(len(dropped))
        count_written(self.model_name, [a for a in now if a.entry_id not in dropped],
                      time.time() * 1000)
        self.inflight.release(a.entry_id for a in now)


def served_online_ms(answered: list[Answer], latencies_s: list[float]) -> list[float]:
    """The latencies the target is held to: refusals are not latencies, and batch jobs'
    lines wait behind online calls by design."""
    return [s * 1000 for a, s in zip(answered, latencies_s, strict=True)
            if a.envelope["ok"] and not a.background]


def count_written(model_name: str, answered: list[Answer], written_ms: float) -> list[float]:
    """Count the answers written by status and record their end-to-end latencies (in s,
    returned)."""
    for status, count in Counter(a.status for a in answered).items():
        metrics.REQUESTS.labels(model_name, status).inc(count)  # labels() takes a lock
    latencies_s = end_to_end_s(written_ms, [a.enqueued_ms for a in answered])
    metrics.observe_all(metrics.END_TO_END.labels(model_name), latencies_s)
    return latencies_s


def encode(answer: Answer) -> Reply:
    """The envelope in the request's content type; an unserialisable result becomes an
    `internal` error, so the reply thread lives on and the request is still answered."""
    try:
        data = encode_envelope(answer.envelope, answer.content_type)
    except Exception as exc:
        log.error("reply.unserialisable", request_id=answer.envelope["id"], error=str(exc))
        answer.envelope = protocol.error_envelope(
            answer.envelope["id"], ErrorCode.INTERNAL, f"result could not be encoded: {exc}")
        data = protocol.encode(answer.envelope, answer.content_type)
    return Reply(answer.entry_id, answer.reply_to, data)
