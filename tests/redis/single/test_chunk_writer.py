"""The generate loop's chunk writer (worker/pipeline/chunk_writer.py), against a real Redis:
writes go out in order on their own thread, the loop is not held while one is in flight, and
answers reach the reply thread only once the chunks queued before them are in Redis."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from producer import protocol
from producer.protocol import ErrorCode
from producer.request_entry import Request
from worker.pipeline.answers import AnswerQueue, error_answer
from worker.pipeline.chunk_writer import ChunkWriter, Outgoing
from worker.pipeline.retry import Grace, RedisRetry, ShutdownExpired
from worker.streams.server import free_port
from worker.streams.token_streams import TokenStreams

KEY = "redbatch:stream:req"


def chunk(index: int) -> Outgoing:
    return Outgoing(KEY, index, {"n": index}, protocol.MSGPACK)


def writer_for(r: redis.Redis, answers: AnswerQueue) -> ChunkWriter:
    streams = TokenStreams(r, "redbatch:requests:m", "workers", "c1", 60_000,
                           "redbatch:answered:m")
    return ChunkWriter(streams, RedisRetry(Grace()), answers)


def test_writes_keep_their_order_and_answers_follow_their_chunks(r: redis.Redis) -> None:
    answers = AnswerQueue()
    writer = writer_for(r, answers)
    answer = error_answer("1-1", Request("req", b"", protocol.MSGPACK, ""),
                          ErrorCode.MODEL_ERROR, "after the chunks")
    for index in range(1, 41):  # one chunk per write, as steps queue them
        writer.write([chunk(index)],
                     answers=[answer] if index == 40 else ())
    got = answers.next()  # the reply thread's side: blocks until the answer is queued
    assert got == [answer]
    assert r.xlen(KEY) == 40, "every chunk was in Redis before its answer was handed on"
    assert [protocol.decode(e[1][b"data"], protocol.MSGPACK)["n"] for e in r.xrange(KEY)] == \
        list(range(1, 41)), "in order, encoded on the writer's thread"
    writer.close()


def test_the_loop_is_not_held_by_a_write_in_flight(r: redis.Redis) -> None:
    writer = writer_for(r, AnswerQueue())
    writer.write([chunk(1)])
    writer.wait()
    r.execute_command("CLIENT", "PAUSE", 400, "WRITE")  # a slow round trip, on the server
    started = time.monotonic()
    writer.write([chunk(2)])
    queued_s = time.monotonic() - started
    writer.wait()
    waited_s = time.monotonic() - started
    assert queued_s < 0.1 < 0.3 < waited_s, (queued_s, waited_s)
    assert r.xlen(KEY) == 2
    writer.close()


def test_cancel_flags_come_back_with_the_wait(r: redis.Redis) -> None:
    writer = writer_for(r, AnswerQueue())
    r.set("redbatch:cancel:b", 1, px=10_000)
    writer.write([], {"1-1": "redbatch:cancel:a", "2-1": "redbatch:cancel:b"})
    assert writer.wait() == {"2-1"}
    assert writer.wait() == set(), "each write's flags are read once"
    writer.close()
    assert not any(t.name.startswith("redbatch-chunks") for t in threading.enumerate())


def test_a_write_that_cannot_go_out_raises_at_the_wait_and_hands_no_answer_on() -> None:
    """Redis gone while the shutdown grace runs out: the loop hears of it at its next wait,
    and the answers queued behind the chunks are not handed to the reply thread."""
    answers = AnswerQueue()
    gone = redis.Redis(port=free_port(), socket_connect_timeout=0.2)  # nothing listens there
    grace = Grace()
    streams = TokenStreams(gone, "redbatch:requests:m", "workers", "c1", 60_000,
                           "redbatch:answered:m")
    writer = ChunkWriter(streams, RedisRetry(grace), answers)
    grace.start(0.3)
    answer = error_answer("1-1", Request("req", b"", protocol.MSGPACK, ""),
                          ErrorCode.MODEL_ERROR, "behind the chunk")
    writer.write([chunk(1)], answers=[answer])  # queued: the loop goes on
    with pytest.raises(ShutdownExpired):
        writer.wait()
    answers.close()
    assert answers.next() is None, "no answer overtook its chunk"
    writer.close()
