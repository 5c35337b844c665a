"""A batch's state scripts on a real Redis: each line answered once, whatever repeats."""

from __future__ import annotations

import asyncio
import time
from array import array

import redis
import redis.asyncio as aioredis

from producer.batches import keys, scripts
from producer.batches.pacing import Moved
from producer.batches.runner import STALE_MS, Runner, RunnerConfig
from producer.batches.store import UPLOAD_TTL_MS, BatchStore


def test_a_line_is_answered_once_and_the_batch_finishes_with_its_files(r: redis.Redis) -> None:
    batch = keys.new_batch_id()
    k = keys.BatchKeys("redbatch", batch)
    r.hset(k.meta, mapping={"id": batch, "owner": "public", "status": "in_progress"})
    admit, settle, finish = (r.register_script(s) for s in (
        scripts.ADMIT, scripts.SETTLE, scripts.FINISH))
    admit_keys = [k.meta, k.done, k.flight, k.deferred]
    assert admit(keys=admit_keys, args=[3, 99_999, 0, 0, 1, 0, 2, 0]) == 3
    r.lpush(k.reply, b"a", b"b")
    settle_keys = [k.meta, k.done, k.flight, k.deferred, k.parts, k.output, k.errors, k.reply]
    # line 0 answered twice (a redelivery), line 1 shed (deferred), nothing else
    args = [1, 2, 0, 1, b'{"ok":0}', 0, 1, b'{"ok":0}', 1, 1, "0", 5, 0, 0]
    assert settle(keys=settle_keys, args=args) == 1
    assert r.lrange(k.output, 0, -1) == [b'{"ok":0}'] and r.lrange(k.reply, 0, -1) == [b"b"]
    # a line in flight keeps its attempt and its due time: line 1's is now the retry's
    assert sorted(r.hkeys(k.flight)) == [b"1", b"2"]
    assert r.zrange(k.deferred, 0, -1, withscores=True) == [(b"1", 5.0), (b"2", 99_999.0)]
    assert settle(keys=settle_keys, args=[0, 1, 0, 1, b"again", 0, 0, 0]) == 0
    finish_keys = [k.meta, k.done, k.flight, k.deferred, k.parts, k.output, k.errors,
                   k.output_meta, k.errors_meta, k.order]
    r.set(k.order, b"\0" * 12)
    assert finish(keys=finish_keys, args=["expired", 9, 1, 1, b"e1", 2, b"e2", 0, b"x"]) == 1
    meta = r.hgetall(k.meta)
    assert meta[b"status"] == b"expired" and meta[b"failed"] == b"2"
    assert meta[b"completed"] == b"1" and meta[b"output_file_id"].endswith(b"-output")
    assert r.lrange(k.errors, 0, -1) == [b"e1", b"e2"]
    assert r.hget(k.errors_meta, "bytes") == b"6"
    assert not r.exists(k.flight, k.deferred, k.order)
    assert admit(keys=[k.meta, k.done, k.flight, k.deferred], args=[4, 0, 3, 0]) == -1


def test_a_lease_is_held_by_one_runner_until_it_lapses(r: redis.Redis) -> None:
    lease = r.register_script(scripts.LEASE)
    k = keys.BatchKeys("redbatch", keys.new_batch_id())
    lease_keys = [k.lease, k.flight, k.deferred]
    assert lease(keys=lease_keys, args=["a", 10_000, 0]) == 2
    assert lease(keys=lease_keys, args=["a", 10_000, 0]) == 1
    assert lease(keys=lease_keys, args=["b", 10_000, 0]) == 0
    r.delete(k.lease)
    assert lease(keys=lease_keys, args=["b", 10_000, 0]) == 2


def test_a_batch_taken_over_has_its_lines_in_flight_due_again_soon(r: redis.Redis) -> None:
    """The holder that died may have recorded lines in flight and never queued them: the
    next holder admits them again by the takeover time, not the flight timeout."""
    lease = r.register_script(scripts.LEASE)
    k = keys.BatchKeys("redbatch", keys.new_batch_id())
    r.hset(k.flight, mapping={"0": 1, "1": 2, "2": 1})
    r.zadd(k.deferred, {"0": 900_000, "1": 5})
    assert lease(keys=[k.lease, k.flight, k.deferred], args=["b", 10_000, 100]) == 2
    assert r.zrange(k.deferred, 0, -1, withscores=True) == [
        (b"1", 5.0), (b"0", 100.0), (b"2", 100.0)]
    r.zadd(k.deferred, {"0": 900_000})
    assert lease(keys=[k.lease, k.flight, k.deferred], args=["b", 10_000, 100]) == 1
    assert r.zscore(k.deferred, "0") == 900_000


def test_create_refuses_a_second_batch_of_the_same_id(r: redis.Redis) -> None:
    create = r.register_script(scripts.CREATE)
    meta = keys.BatchKeys("redbatch", keys.batch_id_for("public", "job-1")).meta
    assert create(keys=[meta], args=["status", "validating"]) == 1
    assert create(keys=[meta], args=["status", "failed"]) == 0
    assert r.hget(meta, "status") == b"validating"


def test_cancel_and_start_move_only_from_their_states(r: redis.Redis) -> None:
    k = keys.BatchKeys("redbatch", keys.new_batch_id())
    meta = k.meta
    r.hset(meta, "status", "validating")
    start, cancel = r.register_script(scripts.START), r.register_script(scripts.CANCEL)
    order = array("I", [2, 0, 1]).tobytes()
    assert start(keys=[meta, k.order], args=["in_progress", 5, 3, "", "minilm", order]) == 1
    assert start(keys=[meta, k.order], args=["failed", 6, 3, "", "minilm", b""]) == 0
    assert r.get(k.order) == order
    assert cancel(keys=[meta], args=[7]) == b"cancelling"
    assert cancel(keys=[meta], args=[8]) == b"cancelling"
    assert r.hget(meta, "cancelling_at") == b"7"


def test_a_runner_waits_for_a_create_under_way_and_drops_one_that_was_lost(r: redis.Redis,
                                                                          redis_url: str
                                                                          ) -> None:
    """The active set is written before the batch's hash: an id listed just now with no
    hash yet is a create under way (kept); one listed long ago, a create that died (dropped)."""
    now_ms = int(time.time() * 1000)
    active = keys.active_batches("redbatch")
    r.zadd(active, {"batch_new": now_ms, "batch_lost": now_ms - STALE_MS - 1})

    async def one_round() -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = BatchStore(client, "redbatch")
        runner = Runner(store, lambda model: None, None, RunnerConfig(), "test")  # type: ignore[arg-type]
        await runner.round()
        await client.aclose()

    asyncio.run(one_round())
    assert r.zrange(active, 0, -1) == [b"batch_new"]


def test_an_upload_broken_off_expires_and_a_published_one_is_kept(r: redis.Redis,
                                                                   redis_url: str) -> None:
    async def save(file_id: str, publish: bool) -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = BatchStore(client, "redbatch")
        await store.save_lines(file_id, 0, [b'{"a": 1}', b'{"a": 2}'])
        if publish:
            await store.publish_file({"id": file_id, "owner": "public", "created_ms": 1,
                                      "lines": 2})
        await client.aclose()

    broken, published = keys.new_file_id(), keys.new_file_id()
    asyncio.run(save(broken, publish=False))
    asyncio.run(save(published, publish=True))
    assert 0 < r.pttl(keys.file_keys("redbatch", broken)[1]) <= UPLOAD_TTL_MS
    assert r.pttl(keys.file_keys("redbatch", published)[1]) == -1
    assert r.hlen(keys.file_keys("redbatch", published)[1]) == 2


def test_lines_are_admitted_in_the_stored_order_or_the_files(r: redis.Redis,
                                                             redis_url: str) -> None:
    """Shortest first where validation stored an order; file order for a batch without one
    (one started before orders were stored)."""
    async def read() -> tuple[list[int], list[int], list[int]]:
        client = aioredis.Redis.from_url(redis_url)
        store = BatchStore(client, "redbatch")
        k = store.keys("batch_ordered")
        await client.hset(k.meta, "status", "validating")
        await store.start("batch_ordered", "in_progress", 1, 4, "", "m", [3, 1, 0, 2])
        found = (await store.ordered("batch_ordered", 1, 2),
                 await store.ordered("batch_ordered", 3, 5),
                 await store.ordered("batch_plain", 2, 3))
        await client.aclose()
        return found

    assert asyncio.run(read()) == ([1, 0], [2], [2, 3, 4])


def test_a_runner_with_lines_in_flight_looks_again_soon(r: redis.Redis, redis_url: str) -> None:
    """Lines queued and no reply yet: the round says WAITING (polled at flight_poll_s), not
    IDLE (poll_s, 0.2 s, by which time the workers had finished the window and idled)."""
    batch = keys.new_batch_id()
    k = keys.BatchKeys("redbatch", batch)
    r.hset(k.meta, mapping={"id": batch, "owner": "public", "status": "in_progress",
                            "model": "m", "total": 4, "cursor": 4, "created_at": 1,
                            "expires_at": int(time.time()) + 3600})
    r.zadd(keys.active_batches("redbatch"), {batch: int(time.time() * 1000)})

    class Group:  # the runner reads only the consumer group's name before it finds no room
        group = "redbatch"

    async def rounds() -> list[Moved]:
        client = aioredis.Redis.from_url(redis_url)
        runner = Runner(BatchStore(client, "redbatch"), lambda model: Group(),  # type: ignore[arg-type, return-value]
                        None, RunnerConfig(window=2), "test")  # type: ignore[arg-type]
        found = [await runner.round()]
        r.hset(k.flight, mapping={0: 1, 1: 1})  # lines 0 and 1 admitted, in the stream
        r.zadd(k.deferred, {"0": 2**50, "1": 2**50})  # due again far later
        found.append(await runner.round())
        await client.aclose()
        return found

    idle, waiting = asyncio.run(rounds())
    assert (idle, waiting) == (Moved.IDLE, Moved.WAITING)


def test_a_cancelled_batch_stops_the_generations_it_has_in_flight(r: redis.Redis,
                                                                  redis_url: str) -> None:
    """Its lines in flight get their cancel keys (a worker ends such a generation within two
    steps, docs/protocol.md), then every line unanswered its `batch_cancelled` error line."""
    batch, file_id = keys.new_batch_id(), "file-cancelled-lines"
    k = keys.BatchKeys("redbatch", batch)
    r.hset(k.meta, mapping={"id": batch, "owner": "public", "status": "cancelling",
                            "model": "m", "total": 3, "cursor": 2, "created_at": 1,
                            "input_file_id": file_id, "expires_at": int(time.time()) + 60})
    r.hset(k.flight, mapping={0: 1, 1: 2})  # line 1 on its second attempt
    r.zadd(keys.active_batches("redbatch"), {batch: int(time.time() * 1000)})

    async def one_round() -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = BatchStore(client, "redbatch")
        await store.save_lines(file_id, 0, [b'{"custom_id": "c%d"}' % n for n in range(3)])
        await Runner(store, lambda model: None, None, RunnerConfig(), "test").round()  # type: ignore[arg-type]
        await client.aclose()

    asyncio.run(one_round())
    stopped = [f"redbatch:cancel:{keys.request_id(batch, 0, 1, 0)}",
               f"redbatch:cancel:{keys.request_id(batch, 1, 2, 0)}"]
    assert r.exists(*stopped) == 2 and all(r.pttl(key) > 0 for key in stopped)
    assert r.hget(k.meta, "status") == b"cancelled" and r.hget(k.meta, "failed") == b"3"
