"""Breaking things on purpose: kill -9, SIGSTOP, a Redis crash, SIGTERM. Every request must get
exactly one reply (counted per id on a shared reply key) and nothing may be left pending.

Workers are real `python -m worker` processes on the echo model (5 ms per batch) with
claim_idle_ms = 1000. Each test prints a RELIABILITY line with its figures (pytest -s).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.protocol import stream_key
from tests.rigs.chaos import (
    CLAIM_IDLE_MS,
    ECHO_FLAGS,
    Replies,
    WorkerProcess,
    heaviest_on_redis_7_only,
    pending,
    report,
    request_ids,
    wait_until,
)
from worker.streams.server import RedisServer

STREAM = stream_key("redbatch", "echo")
REQUESTS = 2000
pytestmark = pytest.mark.slow


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    started: list[WorkerProcess] = []

    def start(url: str, name: str, *flags: str) -> WorkerProcess:
        started.append(WorkerProcess(url, tmp_path / f"{name}.log", *ECHO_FLAGS,
                                     "--consumer", name, *flags))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


def submit(url: str, count: int = REQUESTS) -> tuple[list[str], Replies]:
    client = Client(url, "echo")
    reply_key = client.new_reply_key()
    ids = client.submit_many(({"i": i} for i in range(count)), reply_to=reply_key)
    client.close()
    return ids, Replies(url, reply_key)


def hold_entries(r: redis.Redis, worker: WorkerProcess, replies: Replies, name: str) -> None:
    """Wait until the load is under way and `name` holds unanswered entries."""
    wait_until(lambda: replies.poll() >= 0 and len(replies.counts) >= 200
               and bool(pending(r, STREAM, consumer=name)), 60, f"{name} to hold entries",
               interval=0.005)


def two_workers_a_holding_entries(url: str, r: redis.Redis,
                                  spawn: Any) -> tuple[WorkerProcess, list[str], Replies]:
    """Workers "a" and "b" serving the load, once "a" holds unanswered entries."""
    a, b = spawn(url, "a"), spawn(url, "b")
    a.wait_serving()
    b.wait_serving()
    ids, replies = submit(url)
    hold_entries(r, a, replies, "a")
    return a, ids, replies


def assert_exactly_once(r: redis.Redis, ids: list[str], replies: Replies) -> None:
    assert set(replies.counts) == set(ids)
    assert replies.duplicates == 0, replies.counts.most_common(3)
    assert all(e["ok"] and e["result"]["i"] == int(i) for i, e in
               zip(range(len(ids)), (replies.envelopes[x] for x in ids), strict=True))
    wait_until(lambda: not pending(r, STREAM), 5, "nothing pending")


def test_kill_9_mid_load_every_request_answered_once(redis_url: str, r: redis.Redis,
                                                     spawn) -> None:
    a, ids, replies = two_workers_a_holding_entries(redis_url, r, spawn)
    a.process.kill()
    killed_at = time.monotonic()
    a.process.wait()
    orphans = request_ids(r, STREAM, pending(r, STREAM, consumer="a"))
    assert orphans
    replies.wait_for(ids, 60)
    recovered_s = max(replies.arrived_at[i] for i in orphans) - killed_at
    replies.linger(2 * CLAIM_IDLE_MS / 1000)
    assert_exactly_once(r, ids, replies)
    wait_until(lambda: r.xlen(STREAM) == 0, 10, "answered entries trimmed")
    report("kill-9", redis=r.info()["redis_version"], sent=len(ids),
           answered=len(replies.counts), duplicates=replies.duplicates,
           pending_left=len(pending(r, STREAM)), orphaned_by_kill=len(orphans),
           recover_s=recovered_s, claim_idle_ms=CLAIM_IDLE_MS)


def test_frozen_worker_whose_entries_were_claimed_does_not_answer_again(
        redis_url: str, r: redis.Redis, spawn) -> None:
    a, ids, replies = two_workers_a_holding_entries(redis_url, r, spawn)
    a.signal(signal.SIGSTOP)
    frozen = request_ids(r, STREAM, pending(r, STREAM, consumer="a"))
    assert frozen, "a answered everything before it froze"
    replies.wait_for(ids, 60)  # b claimed and answered a's entries
    a.signal(signal.SIGCONT)
    wait_until(lambda: a.logged("replies.dropped_not_owner"), 30, "a's late results")
    replies.linger(2 * CLAIM_IDLE_MS / 1000)
    assert_exactly_once(r, ids, replies)
    report("sigstop", redis=r.info()["redis_version"], sent=len(ids),
           answered=len(replies.counts), duplicates=replies.duplicates,
           pending_left=len(pending(r, STREAM)), held_while_frozen=len(frozen),
           claim_idle_ms=CLAIM_IDLE_MS)


def test_redis_crash_and_restart_with_aof_mid_load(redis_server: RedisServer, tmp_path: Path,
                                                   spawn) -> None:
    server = RedisServer(tmp_path / "redis", binary=redis_server.binary,
                         appendfsync="always").start()
    try:
        r = redis.Redis.from_url(server.url)
        a = spawn(server.url, "a")
        b = spawn(server.url, "b")
        a.wait_serving()
        b.wait_serving()
        ids, replies = submit(server.url)
        wait_until(lambda: replies.poll() >= 0 and len(replies.counts) >= 300, 60, "load")
        server.kill()
        crashed_at = time.monotonic()
        time.sleep(1.0)
        server.start()
        replies.wait_for(ids, 90)
        recovered_s = time.monotonic() - crashed_at
        replies.linger(2 * CLAIM_IDLE_MS / 1000)
        assert_exactly_once(r, ids, replies)
        assert a.process.poll() is None and b.process.poll() is None
        report("redis-restart", redis=r.info()["redis_version"], sent=len(ids),
               answered=len(replies.counts), duplicates=replies.duplicates,
               pending_left=len(pending(r, STREAM)), down_s=1.0, all_answered_after_s=recovered_s)
    finally:
        server.stop()


def test_sigterm_answers_what_is_held_and_exits_0_within_the_grace(
        redis_url: str, r: redis.Redis, spawn) -> None:
    heaviest_on_redis_7_only(r)
    grace_s = 10.0
    # 20 ms a batch: the 2000 requests take "a" alone 2.5 s or more, so the signal lands
    # while most are still unread, however late this process sees the first 200 replies
    a = spawn(redis_url, "a", "--shutdown-grace-s", str(grace_s),
              "--model-options", '{"delay_ms": 20}')
    a.wait_serving()
    ids, replies = submit(redis_url)
    hold_entries(r, a, replies, "a")
    a.signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    assert a.process.wait(grace_s + 5) == 0
    exit_s = time.monotonic() - signalled_at
    assert exit_s < grace_s
    assert pending(r, STREAM) == []  # everything it held was answered and acked
    replies.poll()
    answered_before_exit = len(replies.counts)
    assert answered_before_exit < len(ids)
    spawn(redis_url, "b").wait_serving()  # the rest was never read: another worker takes it
    replies.wait_for(ids, 60)
    replies.linger(0.5)
    assert_exactly_once(r, ids, replies)
    report("sigterm", redis=r.info()["redis_version"], sent=len(ids),
           answered=len(replies.counts), duplicates=replies.duplicates,
           pending_left=len(pending(r, STREAM)), exit_code=0, exit_s=exit_s,
           shutdown_grace_s=grace_s, answered_by_first_worker=answered_before_exit)


def test_second_signal_exits_at_once_and_loses_nothing(redis_url: str, r: redis.Redis,
                                                       spawn) -> None:
    heaviest_on_redis_7_only(r)
    # A batch takes 5 s, so the graceful drain the first signal starts cannot end before
    # the second one arrives (with 300 ms, a batch near its end could, on a loaded machine).
    slow = ("--model-options", '{"delay_ms": 5000}', "--shutdown-grace-s", "30",
            "--warmup", "false")
    a = spawn(redis_url, "a", *slow)
    a.wait_serving()
    ids, replies = submit(redis_url, 200)
    wait_until(lambda: bool(pending(r, STREAM, consumer="a")), 30, "a to hold entries")
    a.signal(signal.SIGTERM)
    time.sleep(0.2)
    a.signal(signal.SIGTERM)
    assert a.process.wait(5) == 128 + signal.SIGTERM  # 143, as a shell reports it
    assert pending(r, STREAM, consumer="a")  # left pending, not acked without a reply
    spawn(redis_url, "a").wait_serving()  # same name: drains what its predecessor held
    replies.wait_for(ids, 60)
    assert_exactly_once(r, ids, replies)
