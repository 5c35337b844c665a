"""The producer library, sync and asyncio, against a real redis-server and an echo worker."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from producer import AsyncClient, Client, RequestFailed, ResultTimeout, protocol
from producer import request_base as client_module
from producer.protocol import JSON, MSGPACK

STREAM = "redbatch:requests:echo"


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    client = Client(redis_url, "echo")
    yield client
    client.close()


def past_ms() -> int:
    return int(time.time() * 1000) - 1000


def test_submit_writes_one_protocol_entry(r: redis.Redis, redis_url: str) -> None:
    client = Client(redis_url, "echo", content_type=JSON)
    request_id = client.submit({"text": "hi"}, reply_to="mine", deadline_ms=123, priority=2)
    [(_, fields)] = r.xrange(STREAM)
    assert fields == {b"id": request_id.encode(), b"payload": b'{"text":"hi"}',
                      b"content_type": JSON.encode(), b"reply_to": b"mine",
                      b"deadline_ms": b"123", b"priority": b"2"}
    client.close()


def test_submit_many_is_pipelined_in_chunks_and_keeps_order(
        r: redis.Redis, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "PIPELINE_CHUNK", 3)
    ids = client.submit_many([{"n": n} for n in range(7)])
    assert len(set(ids)) == 7
    assert [fields[b"id"].decode() for _, fields in r.xrange(STREAM)] == ids


def test_sync_round_trip(client: Client, worker_factory: Callable[..., Any]) -> None:
    with worker_factory():
        assert client.infer({"text": "hi"}, timeout=10) == {"text": "hi"}
        ids = client.submit_many([1, 2, 3])
        assert [client.result(request_id, timeout=10) for request_id in ids] == [1, 2, 3]
        with pytest.raises(RequestFailed) as failed:
            client.infer("too late", timeout=10, deadline_ms=past_ms())
    assert failed.value.code == "deadline_exceeded"
    assert failed.value.request_id and "deadline" in failed.value.message


def test_shared_reply_key_collects_every_reply(client: Client,
                                               worker_factory: Callable[..., Any]) -> None:
    reply_to = client.new_reply_key()
    with worker_factory():
        ids = client.submit_many(range(5), reply_to=reply_to)
        envelopes = client.collect(reply_to, len(ids), timeout=10)
    assert sorted(e["id"] for e in envelopes) == sorted(ids)
    assert sorted(e["result"] for e in envelopes) == list(range(5))


def test_wait_without_a_worker_times_out(client: Client) -> None:
    request_id = client.submit("nobody listens")
    with pytest.raises(ResultTimeout, match=request_id):
        client.wait(request_id, timeout=0.2)


def test_block_slices_add_up_to_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_BLOCK_S", 0.1)
    started, slices = time.monotonic(), []
    for block_s in client_module.block_slices(0.25):
        slices.append(block_s)
        time.sleep(block_s)  # as BLPOP would
    assert time.monotonic() - started >= 0.25
    assert slices[0] == 0.1 and all(0.01 <= block_s <= 0.1 for block_s in slices)
    assert list(client_module.block_slices(0)) == [client_module.MIN_BLOCK_S]


def reply_later(r: redis.Redis, key: str, seconds: float) -> threading.Timer:
    envelope = protocol.encode(protocol.success_envelope("late", "finally", {}), MSGPACK)
    timer = threading.Timer(seconds, r.lpush, args=(key, envelope))
    timer.start()
    return timer


def test_waits_longer_than_the_socket_timeout(r: redis.Redis, redis_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py 8 gives sockets a 5 s timeout: a longer BLPOP would fail, not wait."""
    monkeypatch.setattr(client_module, "MAX_BLOCK_S", 0.1)
    client = Client(redis_client=redis.Redis.from_url(redis_url, socket_timeout=0.3),
                    model="echo")

    async def wait_async() -> Any:
        async_client = AsyncClient(model="echo", redis_client=aioredis.Redis.from_url(
            redis_url, socket_timeout=0.3))
        try:
            return await async_client.result("late", timeout=5)
        finally:
            await async_client.close()

    timer = reply_later(r, client.reply_key("late"), 0.6)
    assert client.result("late", timeout=5) == "finally"
    timer.join()
    timer = reply_later(r, "shared", 0.6)
    assert [e["result"] for e in client.collect("shared", 1, timeout=5)] == ["finally"]
    timer.join()
    timer = reply_later(r, client.reply_key("late"), 0.6)
    assert asyncio.run(asyncio.wait_for(wait_async(), timeout=10)) == "finally"
    timer.join()
    client.close()


def test_unknown_content_type_is_refused_by_the_client() -> None:
    with pytest.raises(ValueError, match="content_type"):
        Client(content_type="text/plain")


@pytest.mark.parametrize("content_type", [MSGPACK, JSON])
def test_asyncio_client(redis_url: str, worker_factory: Callable[..., Any],
                        content_type: str) -> None:
    async def scenario() -> None:
        client = AsyncClient(redis_url, "echo", content_type=content_type)
        try:
            assert await client.infer({"text": "hi"}, timeout=10) == {"text": "hi"}
            ids = await client.submit_many([1, 2, 3])
            assert [await client.result(i, timeout=10) for i in ids] == [1, 2, 3]
            with pytest.raises(RequestFailed) as failed:
                await client.infer("too late", timeout=10, deadline_ms=past_ms())
            assert failed.value.code == "deadline_exceeded"
            with pytest.raises(ResultTimeout):
                await client.wait("never-submitted", timeout=0.2)
        finally:
            await client.close()

    with worker_factory():
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
