"""A producer that tries to make workers touch keys that are not theirs (issue 30), on a real
Redis with a real worker: every finding of the review, reproduced, and refused."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from producer import Client, protocol
from tests.rigs.servers import wait_until
from tests.rigs.tiny_lm import build_tiny_lm
from worker.observe import metrics

STREAM = "redbatch:requests:echo"


@pytest.fixture(scope="module")
def tiny_lm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-hostile"))


def metric(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def envelope_on(r: redis.Redis, key: str, timeout: int = 10) -> dict[str, Any]:
    popped: Any = r.blpop([key], timeout=timeout)
    assert popped is not None, f"no reply on {key}"
    return protocol.decode_envelope(popped[1])


def victim_stream(r: redis.Redis) -> str:
    """Another model's request stream, with its group and a backlog."""
    victim = "redbatch:requests:other"
    for n in range(3):
        r.xadd(victim, {"id": f"v{n}", "payload": msgpack.packb(n)})
    r.xgroup_create(victim, "workers", id="0")
    return victim


@pytest.mark.parametrize("target", ["redbatch:requests:other", "app:sessions",
                                    "redbatch:answered:echo", "redbatch:stream:mine"])
def test_a_list_reply_to_outside_the_reply_keys_is_refused_and_nothing_written_there(
        r: redis.Redis, worker_factory: Callable[..., Any], target: str) -> None:
    """Findings 2 and 3: appending to any list, expiring it, creating lists anywhere."""
    victim = victim_stream(r)
    r.rpush("app:sessions", "kept")
    before = {key: (r.type(key), r.pttl(key)) for key in (victim, "app:sessions")}
    with worker_factory(model="echo"):
        r.xadd(STREAM, {"id": "evil", "payload": msgpack.packb("x"), "reply_to": target})
        error = envelope_on(r, "redbatch:reply:evil")
    assert error["ok"] is False and error["error"]["code"] == "invalid_request"
    assert error["error"]["field"] == "reply_to"
    assert {key: (r.type(key), r.pttl(key)) for key in before} == before
    assert r.lrange("app:sessions", 0, -1) == [b"kept"] and r.xlen(victim) == 3
    if target != "app:sessions":
        assert r.type(target) != b"list"  # the counter is the worker's own string


def test_a_too_long_reply_to_is_refused_on_the_default_key(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Finding 11: an 8 MiB reply_to became an 8 MiB key name."""
    with worker_factory(model="echo"):
        r.xadd(STREAM, {"id": "long", "payload": msgpack.packb("x"),
                        "reply_to": "redbatch:reply:" + "x" * 8000})
        error = envelope_on(r, "redbatch:reply:long")
    assert error["error"]["field"] == "reply_to" and "longer than 512" in error["error"]["message"]
    assert r.dbsize() <= 4  # the stream, the worker's own keys: no 8 kB key name


def test_entries_of_many_fields_or_bytes_are_answered_before_any_work(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Findings 4 and 11: 5,000 fields, a huge extra field, a huge content_type."""
    r.xadd(STREAM, {"id": "fields", "payload": msgpack.packb("x"),
                    **{f"f{n}": "" for n in range(5000)}})
    r.xadd(STREAM, {"id": "bytes", "payload": msgpack.packb("x"), "junk": "j" * (2 << 20)})
    r.xadd(STREAM, {"id": "ctype", "payload": b"x", "content_type": "t" * (1 << 20)})
    with worker_factory(model="echo"):
        for request_id in ("fields", "bytes"):
            error = envelope_on(r, f"redbatch:reply:{request_id}")["error"]
            assert error["reason"] == "entry_too_large", error
        error = envelope_on(r, "redbatch:reply:ctype")["error"]
        assert error["field"] == "content_type" and len(error["message"]) < 200
        assert Client(model="echo", redis_client=r).infer("fine", timeout=10) == "fine"


def test_a_generative_reply_to_cannot_expire_another_models_stream(
        r: redis.Redis, worker_factory: Callable[..., Any], tiny_lm_path: Path) -> None:
    """Finding 1: a token stream's PEXPIRE emptied another model's request stream."""
    victim = victim_stream(r)
    options = {"path": str(tiny_lm_path), "max_new_tokens": 4}
    with worker_factory(model="causal_lm", model_options=options, result_ttl_ms=1000):
        for n, target in enumerate([victim, "redbatch:reply:mine"]):
            r.xadd("redbatch:requests:causal_lm", {
                "id": f"g{n}", "content_type": protocol.JSON, "reply_to": target,
                "payload": json.dumps({"prompt": "hello", "max_new_tokens": 2})})
            data = _done_entry(r, f"redbatch:stream:g{n}")
            assert data["ok"] is False and data["error"]["field"] == "reply_to"
    assert r.pttl(victim) == -1 and r.xlen(victim) == 3
    assert r.xinfo_groups(victim)[0]["name"] == b"workers"
    assert not r.exists("redbatch:reply:mine")


def _done_entry(r: redis.Redis, key: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for _, fields in r.xrange(key):
            envelope = json.loads(fields[b"data"])
            if envelope["type"] == "done":
                return envelope
        time.sleep(0.05)
    raise AssertionError(f"no done entry on {key}")


def test_squatted_internal_keys_do_not_stop_the_worker(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Finding 3: lists placed at the answered counter, the workers hash and the dead-letter
    stream made every worker exit (WRONGTYPE in a worker thread is fatal)."""
    for key in ("redbatch:answered:echo", "redbatch:workers:echo", "redbatch:dead:echo"):
        r.rpush(key, "squat")
    poison = r.xadd(STREAM, {"id": "poison", "payload": msgpack.packb("p")})
    r.xgroup_create(STREAM, "workers", id="0")
    r.xreadgroup("workers", "ghost", {STREAM: ">"})
    r.xclaim(STREAM, "workers", "ghost", 0, [poison], retrycount=9)
    skipped = metric("redbatch_internal_key_errors_total", model="echo", key="answered")
    with worker_factory(model="echo", claim_idle_ms=100, max_deliveries=3) as worker:
        client = Client(model="echo", redis_client=r)
        assert [client.infer(n, timeout=10) for n in range(3)] == [0, 1, 2]
        dead = envelope_on(r, "redbatch:reply:poison")
        assert dead["error"]["code"] == "dead_letter"
        assert not worker.failed and not worker.stopping.is_set()
    assert metric("redbatch_internal_key_errors_total", model="echo",
                  key="answered") > skipped
    assert metric("redbatch_internal_key_errors_total", model="echo", key="dead") >= 1
    assert r.xpending(STREAM, "workers")["pending"] == 0


def test_a_poison_entry_of_many_fields_is_dead_lettered(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Finding 4: MOVE_TO_DEAD unpacked every field onto Lua's stack and failed."""
    poison = r.xadd(STREAM, {"id": "wide", "payload": msgpack.packb("p"),
                             **{f"f{n}": "v" for n in range(5000)}})
    r.xgroup_create(STREAM, "workers", id="0")
    r.xreadgroup("workers", "ghost", {STREAM: ">"})
    r.xclaim(STREAM, "workers", "ghost", 0, [poison], retrycount=9)
    with worker_factory(model="echo", claim_idle_ms=100, max_deliveries=3) as worker:
        assert envelope_on(r, "redbatch:reply:wide")["error"]["code"] == "dead_letter"
        assert not worker.failed
    [(_, fields)] = r.xrange("redbatch:dead:echo")
    assert fields[b"dead:fields"] == b"5002" and fields[b"id"] == b"wide"


def test_a_second_entry_with_an_id_in_flight_is_answered_duplicate_id(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Finding 6: two requests with one id were both served onto one key."""
    with worker_factory(model="echo", model_options={"delay_ms": 300}):
        for value in ("first", "second"):
            r.xadd(STREAM, {"id": "same", "payload": msgpack.packb(value)})
        envelopes = [envelope_on(r, "redbatch:reply:same") for _ in range(2)]
        outcomes = sorted(e.get("result") or e["error"]["code"] for e in envelopes)
        assert outcomes == ["duplicate_id", "first"]
        r.xadd(STREAM, {"id": "same", "payload": msgpack.packb("again"),
                        "reply_to": "redbatch:reply:elsewhere"})  # another key: no clash
        assert envelope_on(r, "redbatch:reply:elsewhere")["result"] == "again"


def test_the_client_ignores_a_forged_envelope(
        r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """Finding 5: an attacker's request aimed at a victim's reply key was returned by the
    victim's infer()."""
    client = Client(model="echo", redis_client=r)
    with worker_factory(model="echo"):
        r.xadd(STREAM, {"id": "attacker", "content_type": protocol.JSON,
                        "payload": json.dumps({"text": "forged"}),
                        "reply_to": "redbatch:reply:victim"})
        wait_until(lambda: r.llen("redbatch:reply:victim") == 1, 10, "the forged reply")
        r.lpush("redbatch:reply:victim", b"\x00not an envelope")
        assert client.infer({"text": "mine"}, request_id="victim", timeout=10) == \
            {"text": "mine"}
    assert client.foreign_envelopes == 2


def test_a_huge_prompt_is_refused_before_it_is_tokenised(
        r: redis.Redis, worker_factory: Callable[..., Any], tiny_lm_path: Path) -> None:
    """Finding 10: a 1 MiB prompt was tokenised (0.7 s) before being refused."""
    options = {"path": str(tiny_lm_path), "max_new_tokens": 4}
    with worker_factory(model="causal_lm", model_options=options) as worker:
        started = time.perf_counter()
        r.xadd("redbatch:requests:causal_lm", {
            "id": "huge", "content_type": protocol.JSON,
            "payload": json.dumps({"prompt": "word " * 200_000, "stream": False})})
        error = envelope_on(r, "redbatch:reply:huge")["error"]
        assert error["reason"] == "context_window"
        assert time.perf_counter() - started < 2.0
        assert not worker.failed


def test_the_gateway_drops_envelopes_of_other_ids(redis_url: str, r: redis.Redis) -> None:
    """Finding 5 in the gateway: its shared reply key and a reply stream it reads may
    receive others' envelopes (any producer can name them as its reply_to)."""
    import asyncio

    import redis.asyncio as aioredis

    from producer.gateway.dispatch import Dispatcher
    from producer.gateway.generation import Generations

    def entry(request_id: str, kind: str) -> bytes:
        return json.dumps({"id": request_id, "type": kind, "ok": True, "text": kind}).encode()

    r.rpush("redbatch:reply:batch", json.dumps({"id": "evil", "ok": True, "result": 0}),
            b"\x00junk", json.dumps({"id": "a", "ok": True, "result": 1}))
    for n, (request_id, kind) in enumerate([("evil", "done"), ("g", "delta"), ("g", "done")]):
        r.xadd("redbatch:stream:g", {"data": entry(request_id, kind)}, id=f"{n + 1}-1")

    async def run() -> tuple[Any, Any]:
        client = aioredis.Redis.from_url(redis_url)
        dispatcher = Dispatcher(client, "redbatch", "workers", None, 5.0)
        collected = await dispatcher._collect("redbatch:reply:batch", {"a"}, iter([1.0] * 5),
                                              await client.blpop(["redbatch:reply:batch"]))
        generations = Generations(client, dispatcher, "redbatch", 5.0)
        read = await generations.read("redbatch:stream:g", "0-0", time.monotonic() + 5, "g")
        await client.aclose()
        return collected, read

    collected, read = asyncio.run(run())
    assert list(collected) == ["a"]
    assert [(i, e["type"]) for i, e in read] == [("2-1", "delta"), ("3-1", "done")]


def test_the_metrics_server_lets_a_silent_connection_go() -> None:
    """Finding 13: each connection held a thread forever."""
    import socket

    from prometheus_client import CollectorRegistry

    from worker.observe.endpoints import start_server

    server = start_server("127.0.0.1", 0, CollectorRegistry(), lambda: {}, timeout_s=0.3)
    try:
        with socket.create_connection(server.server_address[:2], timeout=5) as silent:
            silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            started = time.monotonic()
            assert silent.recv(1024) == b""  # closed by the server
            assert time.monotonic() - started < 3
    finally:
        server.shutdown()


@pytest.mark.parametrize("url", ["redis://h:6379/0?password=s3cret",
                                 "redis://user:s3cret@h:6379/0",
                                 "redis+sentinel://h:26379/m?sentinel_password=s3cret"])
def test_every_password_form_is_masked(url: str) -> None:
    """Finding 14: `?password=` was printed in the start-up error."""
    from producer.connection import redacted

    assert "s3cret" not in redacted(url) and "***" in redacted(url)
