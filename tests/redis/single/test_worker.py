"""The worker end to end against a real redis-server, with the echo model (length = bytes).

Requests are mostly enqueued before the worker starts, so that its first read sees them all
and the batches it forms depend on the policy alone, not on timing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from producer import Client, protocol
from producer.protocol import JSON, MSGPACK
from worker.policy.batching import bucket_of
from worker.streams.replier import Replier, Reply

STREAM = "redbatch:requests:echo"
SHARED = "redbatch:reply:test-replies"
Envelope = dict[str, Any]


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    client = Client(redis_url, "echo")
    yield client
    client.close()


def enqueue(client: Client, payloads: Sequence[Any]) -> list[str]:
    """Submit with readable ids r0, r1... onto the shared reply key."""
    return [client.submit(payload, request_id=f"r{n}", reply_to=SHARED)
            for n, payload in enumerate(payloads)]


def collect(client: Client, count: int, key: str = SHARED) -> dict[str, Envelope]:
    envelopes = client.collect(key, count, timeout=20)
    assert len(envelopes) == count, f"{count - len(envelopes)} replies missing"
    return {e["id"]: e for e in envelopes}


def nbytes(payload: Any) -> int:
    """The echo model's length of a msgpack payload."""
    return len(protocol.encode(payload, protocol.MSGPACK))


def wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def pending_count(r: redis.Redis, stream: str = STREAM) -> int:
    return int(r.xpending(stream, "workers")["pending"])


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_success_envelope_and_meta(client: Client, worker_factory: Callable[..., Any]) -> None:
    with worker_factory(consumer="w1"):
        envelope = client.wait(client.submit({"text": "hi"}, request_id="a"), timeout=10)
    assert envelope["id"] == "a" and envelope["ok"] is True and envelope["result"] == {"text": "hi"}
    meta = envelope["meta"]
    assert meta["model"] == "echo" and meta["worker"] == "w1" and meta["batch_size"] == 1
    assert meta["queue_ms"] >= 0 and meta["compute_ms"] >= 0
    assert meta["padded_length"] == nbytes({"text": "hi"}) and meta["bucket"] == 0


def test_reply_and_ack_are_one_step(r: redis.Redis, client: Client,
                                    worker_factory: Callable[..., Any]) -> None:
    with worker_factory(result_ttl_ms=60_000):
        key = client.reply_key(client.submit("x"))
        wait_until(lambda: bool(r.exists(key)))
        pending = pending_count(r)  # as soon as the reply is visible
        ttl_ms = r.pttl(key)
    assert pending == 0
    assert 0 < ttl_ms <= 60_000


def test_replier_answers_only_entries_this_consumer_owns(r: redis.Redis) -> None:
    r.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    entry_id = r.xadd(STREAM, {"id": "a", "payload": b"x"}).decode()
    r.xreadgroup("workers", "owner", {STREAM: ">"})
    late = Replier(r, STREAM, "workers", "someone-else", 1000, "answered")
    assert late.send([Reply(entry_id, "reply:a", b"late")]) == [entry_id]
    assert not r.exists("reply:a") and pending_count(r) == 1
    owner = Replier(r, STREAM, "workers", "owner", 1000, "answered")
    assert owner.send([Reply(entry_id, "reply:a", b"on time")]) == []
    assert r.lrange("reply:a", 0, -1) == [b"on time"] and pending_count(r) == 0
    assert r.get("answered") == b"1"  # counted once: the dropped late reply is not


def test_replier_handles_a_mixed_call_in_one_script(r: redis.Redis) -> None:
    """Out-of-order ids over several milliseconds: the owned ones are answered and acked,
    a claimed one is dropped, a reply key of the wrong type is acked without a reply."""
    r.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    ids = [r.xadd(STREAM, {"id": f"e{i}", "payload": b"x"}, id=f"{1000 + i // 2}-{i}").decode()
           for i in range(5)]
    r.xreadgroup("workers", "owner", {STREAM: ">"})
    r.xclaim(STREAM, "workers", "thief", 0, [ids[1]])
    r.set("reply:wrong", "not a list")
    before = metric("redbatch_unanswerable_entries_total", model="echo", reason="reply_key_type")
    owner = Replier(r, STREAM, "workers", "owner", 60_000, "answered")
    keys = {i: ("reply:wrong" if i == 3 else f"reply:{i}") for i in range(5)}
    dropped = owner.send([Reply(ids[i], keys[i], f"answer {i}".encode()) for i in (4, 1, 0, 3, 2)])
    assert dropped == [ids[1]]
    for i in (0, 2, 4):
        assert r.lrange(f"reply:{i}", 0, -1) == [f"answer {i}".encode()]
        assert 0 < r.pttl(f"reply:{i}") <= 60_000
    assert not r.exists("reply:1") and r.get("reply:wrong") == b"not a list"
    assert [p["message_id"].decode() for p in r.xpending_range(STREAM, "workers", "-", "+", 10)] \
        == [ids[1]]  # only the thief's entry is still pending
    assert r.get("answered") == b"4"
    assert metric("redbatch_unanswerable_entries_total", model="echo",
                  reason="reply_key_type") == before + 1


def test_mixed_lengths_are_batched_by_bucket(client: Client,
                                             worker_factory: Callable[..., Any]) -> None:
    boundaries = [16, 64, 256]
    payloads = ["x" * n for n in (3, 20, 100, 300, 10, 40, 200, 600, 14, 60)]
    ids = enqueue(client, payloads)
    with worker_factory(bucket_boundaries=boundaries, max_wait_ms=200):
        envelopes = collect(client, len(ids))
    buckets = [bucket_of(nbytes(p), boundaries) for p in payloads]
    for request_id, payload, bucket in zip(ids, payloads, buckets, strict=True):
        meta = envelopes[request_id]["meta"]
        same_bucket = [nbytes(p) for p, b in zip(payloads, buckets, strict=True) if b == bucket]
        assert envelopes[request_id]["result"] == payload
        assert meta["bucket"] == bucket
        assert meta["batch_size"] == len(same_bucket)  # the whole bucket, and nothing else
        assert meta["padded_length"] == max(same_bucket)  # padded to its longest member only


def test_max_batch_size_caps_batches(client: Client, worker_factory: Callable[..., Any]) -> None:
    ids = enqueue(client, ["same"] * 10)
    with worker_factory(bucket_boundaries=[], max_batch_size=4, max_wait_ms=50):
        envelopes = collect(client, len(ids))
    assert Counter(e["meta"]["batch_size"] for e in envelopes.values()) == {4: 8, 2: 2}


def test_max_batch_tokens_caps_padded_tokens(client: Client,
                                             worker_factory: Callable[..., Any]) -> None:
    payloads = ["x" * 98] * 7 + ["y" * 500]  # 100 bytes each, then one above the cap
    ids = enqueue(client, payloads)
    with worker_factory(bucket_boundaries=[], max_batch_tokens=350, max_wait_ms=50):
        envelopes = collect(client, len(ids))
    metas = [envelopes[request_id]["meta"] for request_id in ids]
    assert [m["batch_size"] for m in metas[:7]] == [3, 3, 3, 3, 3, 3, 1]
    assert all(m["batch_size"] * m["padded_length"] <= 350 for m in metas[:7])
    assert (metas[7]["batch_size"], metas[7]["padded_length"]) == (1, 503)  # runs alone


def test_a_lone_request_is_flushed_after_max_wait(client: Client,
                                                  worker_factory: Callable[..., Any]) -> None:
    with worker_factory(max_batch_size=32, max_wait_ms=400):
        started = time.monotonic()
        envelope = client.wait(client.submit("alone"), timeout=10)
        waited = time.monotonic() - started
    assert envelope["ok"] and envelope["meta"]["batch_size"] == 1
    assert waited >= 0.4  # it waited for company first


def test_higher_priority_goes_first_within_a_bucket(r: redis.Redis, client: Client,
                                                    worker_factory: Callable[..., Any]) -> None:
    priorities = [0, 5, -1, 9, 5, 0]
    for n, priority in enumerate(priorities):
        client.submit(n, request_id=f"r{n}", reply_to=SHARED, priority=priority)
    with worker_factory(bucket_boundaries=[], max_batch_size=1, instances=1):  # one server
        wait_until(lambda: r.llen(SHARED) == len(priorities))
        answered = [protocol.decode_envelope(data)["id"] for data in r.lrange(SHARED, 0, -1)]
    assert answered[::-1] == ["r3", "r1", "r4", "r0", "r5", "r2"]  # LPUSH: newest first


def test_deadline_passed_before_reading(client: Client,
                                        worker_factory: Callable[..., Any]) -> None:
    compute_runs = metric("redbatch_compute_seconds_count", model="echo")
    request_id = client.submit("late", deadline_ms=int(time.time() * 1000) - 1)
    with worker_factory():
        envelope = client.wait(request_id, timeout=10)
    assert envelope["error"]["code"] == "deadline_exceeded"
    assert metric("redbatch_compute_seconds_count", model="echo") == compute_runs


def test_deadline_passing_while_queued(client: Client,
                                       worker_factory: Callable[..., Any]) -> None:
    with worker_factory(max_wait_ms=1200) as worker:
        compute_runs = metric("redbatch_compute_seconds_count", model="echo")
        request_id = client.submit("soon late", deadline_ms=int(time.time() * 1000) + 500)
        envelope = client.wait(request_id, timeout=10)
        assert len(worker.batcher) == 0
    assert envelope["error"]["code"] == "deadline_exceeded"
    assert "while queued" in envelope["error"]["message"]
    assert metric("redbatch_compute_seconds_count", model="echo") == compute_runs


def test_malformed_entries_are_answered_or_counted_and_serving_goes_on(
        r: redis.Redis, client: Client, worker_factory: Callable[..., Any]) -> None:
    answerable = {
        "bad-msgpack": {"payload": b"\xc1"},
        "bad-json": {"payload": b"{oops", "content_type": JSON},
        "unknown-type": {"payload": b"hi", "content_type": "text/plain"},
        "no-payload": {},
        "bad-deadline": {"payload": b"\xa1x", "deadline_ms": "tomorrow"},
        "bad-priority": {"payload": b"\xa1x", "priority": "high"},
        "huge": {"payload": b"\xa1x" * 1000},
    }
    for request_id, fields in answerable.items():
        r.xadd(STREAM, {"id": request_id, "reply_to": f"redbatch:reply:{request_id}", **fields})
    unanswerable = [{"payload": b"\xa1x"}, {"id": b"\xff\xfe", "payload": b"\xa1x"},
                    {"id": "i" * 257, "payload": b"\xa1x"}]
    for fields in unanswerable:
        r.xadd(STREAM, fields)
    counted = metric("redbatch_unanswerable_entries_total", model="echo", reason="no_id")
    with worker_factory(max_payload_bytes=1000):
        for request_id in answerable:
            raw: Any = r.blpop([f"redbatch:reply:{request_id}"], timeout=10)
            assert raw is not None, request_id
            envelope = protocol.decode_envelope(raw[1])
            assert envelope["id"] == request_id and envelope["ok"] is False
            assert envelope["error"]["code"] == "invalid_request", envelope
            # JSON requests, and those whose content type is unknown, get JSON replies
            assert (raw[1][:1] == b"{") == (request_id in ("bad-json", "unknown-type"))
        assert client.infer("still serving", timeout=10) == "still serving"
    assert metric("redbatch_unanswerable_entries_total", model="echo",
                  reason="no_id") == counted + len(unanswerable)
    assert pending_count(r) == 0


def test_model_failures_are_answered_and_serving_goes_on(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    clients = {content_type: Client(redis_url, "faulty", content_type=content_type)
               for content_type in protocol.CONTENT_TYPES}
    with worker_factory(model="tests.rigs.plugin_models:FaultyModel", model_name="faulty",
                        max_batch_size=1):
        failed = clients[JSON].wait(clients[JSON].submit("boom"), timeout=10)
        unencodable = [clients[content_type].wait(clients[content_type].submit(name), timeout=10)
                       for content_type, name in [(MSGPACK, "set"), (JSON, "set"),
                                                  (MSGPACK, "big int"), (MSGPACK, "deep"),
                                                  (JSON, "deep")]]
        assert [client.infer("fine", timeout=10) for client in clients.values()] == ["fine"] * 2
    assert failed["error"]["code"] == "model_error"
    assert "the model exploded" in failed["error"]["message"]
    for envelope in unencodable:
        assert envelope["error"]["code"] == "internal"
        assert envelope["error"]["message"].startswith("result could not be encoded")
    for client in clients.values():
        client.close()


def test_at_most_max_inflight_entries_are_held(r: redis.Redis, client: Client,
                                               worker_factory: Callable[..., Any]) -> None:
    ids = enqueue(client, list(range(6)))
    held: list[int] = []
    with worker_factory(max_inflight=2, model_options={"delay_ms": 100}, max_wait_ms=0):
        deadline = time.monotonic() + 20
        while r.llen(SHARED) < len(ids) and time.monotonic() < deadline:
            held.append(pending_count(r))
            time.sleep(0.02)
        envelopes = collect(client, len(ids))
    assert max(held) == 2  # the rest stays in the stream for other workers
    assert all(e["meta"]["batch_size"] <= 2 for e in envelopes.values())
