"""Issue 30, the gateway's part: each finding of the security review, reproduced against a
real served gateway (uvicorn in a thread, its own HTTP protocol) and a real Redis.

(7) a bounded, blocking Redis pool, a cap on calls in flight, readiness on its own
connection; (8) header size cap and header / body read deadlines, over raw sockets; (9)
/v1/models from the workers' registry, no SCAN; (12) a safe bind by default; (15) fixed
messages to callers for Redis failures."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import redis
from structlog.testing import capture_logs

from producer.gateway.serve import bind_refusal
from producer.gateway.settings import load_gateway_settings
from tests.e2e.test_gateway import (  # noqa: F401
    assert_openai_error,
    free_port,
    gateway_factory,
    running_gateway,
)
from tests.rigs.paths import REPO_ROOT
from tests.rigs.sentinel import SentinelRig

ROOT = REPO_ROOT
STUCK = "stuck"  # a model with a live consumer that never answers: calls wait their timeout
LEAKS = ("WRONGTYPE", "127.0.0.1", "Too many connections", "No connection available",
         "Error ", "redis://")


def live_but_silent(r: redis.Redis, model: str = STUCK) -> str:
    """A model whose group has a consumer that announced itself just now (as a worker does)
    and answers nothing."""
    stream = f"redbatch:requests:{model}"
    r.xgroup_create(stream, "workers", id="0", mkstream=True)
    r.xreadgroup("workers", "silent", {stream: ">"}, count=1, block=1)
    r.hset(f"redbatch:workers:{model}", "silent",
           json.dumps({"seen_ms": int(time.time() * 1000), "generative": False}))
    return stream


def embed(base_url: str, model: str = STUCK, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json={"model": model, "input": "x"},
                      timeout=timeout)


@contextmanager
def slow_calls(base_url: str, r: redis.Redis, stream: str,
               count: int) -> Iterator[list[Future[httpx.Response]]]:
    """`count` embeddings calls waiting on the silent model, each holding a Redis connection
    (its BLPOP) until the gateway's request_timeout_s."""
    with ThreadPoolExecutor(count) as pool:
        calls = [pool.submit(embed, base_url) for _ in range(count)]
        deadline = time.monotonic() + 10
        while r.xlen(stream) < count:  # every call has enqueued: each is in its BLPOP now
            assert time.monotonic() < deadline, "the slow calls did not start"
            time.sleep(0.02)
        time.sleep(0.1)
        yield calls


def assert_fixed_message(response: httpx.Response) -> None:
    error = assert_openai_error(response, 503, "redis_unavailable")
    assert error["message"] == "the queue is unavailable; retry later"
    assert not any(leak in response.text for leak in LEAKS), response.text


# --- (7) the Redis pool, the in-flight cap, readiness ------------------------------------------


def test_a_saturated_pool_waits_then_answers_503_while_readyz_answers(
        r: redis.Redis, gateway_factory: Any) -> None:  # noqa: F811
    stream = live_but_silent(r)
    with gateway_factory(redis_pool_size=2, redis_pool_timeout_s=0.5, request_timeout_s=2,
                         model_cache_s=0) as base_url:
        with slow_calls(base_url, r, stream, 2) as calls:
            started = time.monotonic()
            ready = httpx.get(f"{base_url}/readyz", timeout=5)
            assert ready.status_code == 200 and time.monotonic() - started < 0.4
            started = time.monotonic()
            starved = httpx.get(f"{base_url}/v1/models", timeout=5)
            waited = time.monotonic() - started
            assert [c.result().status_code for c in calls] == [504, 504]
        assert_fixed_message(starved)
        assert 0.45 <= waited < 1.9, "it waited for a connection, up to the pool timeout"
        assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200


def test_a_call_waits_for_a_connection_rather_than_failing(r: redis.Redis,
                                                          gateway_factory: Any) -> None:  # noqa: F811
    stream = live_but_silent(r)
    with gateway_factory(redis_pool_size=2, redis_pool_timeout_s=5, request_timeout_s=1,
                         model_cache_s=0) as base_url:
        with slow_calls(base_url, r, stream, 2) as calls:
            listed = httpx.get(f"{base_url}/v1/models", timeout=10)  # the BLPOPs end at 1 s
            assert [c.result().status_code for c in calls] == [504, 504]
    assert listed.status_code == 200, listed.text


def test_the_pool_is_bounded_and_blocking_through_sentinel_too(sentinels: SentinelRig) -> None:
    """Through a Sentinel URL the shared pool is the blocking one too, and readiness keeps
    its own connection."""
    master = sentinels.master.client()
    try:
        master.flushall()
        stream = live_but_silent(master)
        with running_gateway(sentinels.url(), redis_pool_size=1, redis_pool_timeout_s=0.5,
                             request_timeout_s=2, model_cache_s=0) as base_url:
            with slow_calls(base_url, master, stream, 1) as calls:
                ready = httpx.get(f"{base_url}/readyz", timeout=5)
                started = time.monotonic()
                starved = httpx.get(f"{base_url}/v1/models", timeout=5)
                waited = time.monotonic() - started
                assert calls[0].result().status_code == 504
            assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200
    finally:
        master.flushall()
        master.close()
    assert ready.status_code == 200
    assert_fixed_message(starved)
    assert 0.45 <= waited < 1.9, "it waited for a connection, up to the pool timeout"


def test_the_in_flight_cap_is_429_with_retry_after(r: redis.Redis,
                                                   gateway_factory: Any) -> None:  # noqa: F811
    stream = live_but_silent(r)
    with gateway_factory(max_concurrent_requests=2, request_timeout_s=2) as base_url:
        with slow_calls(base_url, r, stream, 2) as calls:
            refused = embed(base_url)
            probes = [httpx.get(f"{base_url}{path}", timeout=5).status_code
                      for path in ("/healthz", "/readyz", "/metrics")]
            assert [c.result().status_code for c in calls] == [504, 504]
        assert_openai_error(refused, 429, "too_many_requests")
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["Retry-After"]) >= 1
        assert probes == [200, 200, 200], "probes and metrics are not counted"
        assert r.xlen(stream) == 2, "the refused call enqueued nothing"
        after = httpx.get(f"{base_url}/v1/models", timeout=5)
        assert after.status_code == 200, "the slots are freed when the calls end"
        metrics = httpx.get(f"{base_url}/metrics", timeout=5).text
    assert 'redbatch_gateway_requests_total{route="/v1/embeddings",status="429"}' in metrics


# --- (8) header size, header and body deadlines, over raw sockets -----------------------------


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection (a reset counts as a
    close), and how long that took; fails past `limit_s`."""
    sock.settimeout(limit_s)
    started, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit_s} s")
    return data, time.monotonic() - started


def send_ignoring_close(sock: socket.socket, data: bytes) -> bool:
    """Whether all of `data` went out before the server closed the connection."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def drip(sock: socket.socket, data: bytes, every_s: float) -> float:
    """Sends `data` one byte every `every_s`, until the server answers or closes (the socket
    turns readable) or all is sent; returns the seconds it dripped."""
    started = time.monotonic()
    for byte in data:
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable or not send_ignoring_close(sock, bytes([byte])):
            break
    return time.monotonic() - started


HEAD = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n"


def test_headers_over_the_cap_are_431(gateway_factory: Any) -> None:  # noqa: F811
    with gateway_factory(max_header_bytes=16384) as base_url:
        with connect(base_url) as sock:  # under the cap: served
            sock.sendall(HEAD + b"X-Pad: " + b"a" * 8000 + b"\r\nConnection: close\r\n\r\n")
            answer, _ = read_until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 200")
        with connect(base_url) as sock:  # a whole block of 64 KB
            sock.sendall(HEAD + b"X-Pad: " + b"a" * 65536 + b"\r\n\r\n")
            answer, _ = read_until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
            "headers_too_large"
        header = b"X-Big: " + b"b" * 4096 + b"\r\n"
        for _ in range(4):  # 1 MB of headers each, never finished: none is held
            with connect(base_url) as sock:
                sent_all = send_ignoring_close(sock, HEAD + header * 256)
                answer, _ = read_until_closed(sock, 5)  # closed, not waiting for the rest
            assert not sent_all or answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert httpx.get(f"{base_url}/healthz").status_code == 200


def test_unfinished_header_blocks_are_closed_at_the_deadline(
        gateway_factory: Any) -> None:  # noqa: F811
    """Silent, unfinished and drip-fed header blocks alike: 408 and closed at the deadline,
    so none holds its connection (and what it sent, below the cap) for longer."""
    with gateway_factory(header_timeout_s=1) as base_url:
        started = time.monotonic()
        socks = [connect(base_url) for _ in range(4)]
        socks[1].sendall(HEAD)
        socks[2].sendall(HEAD + b"X-Pad: " + b"a" * 15000)
        dripped = drip(socks[3], HEAD + b"X-Pad: " + b"a" * 100, 0.2)  # never ends
        answers = [read_until_closed(sock, 4)[0] for sock in socks]
        took = time.monotonic() - started
        for sock in socks:
            sock.close()
        assert httpx.get(f"{base_url}/healthz").status_code == 200
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert 0.8 < dripped < 2 and took < 3


def test_a_drip_fed_body_is_closed_at_the_deadline(r: redis.Redis,
                                                   gateway_factory: Any) -> None:  # noqa: F811
    live_but_silent(r)
    with gateway_factory(body_timeout_s=1) as base_url:
        with connect(base_url) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            dripped = drip(sock, b'{"model": "stuck", "input": "' + b"x" * 70 + b'"}', 0.25)
            answer, _ = read_until_closed(sock, 3)
        assert httpx.get(f"{base_url}/healthz").status_code == 200
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 0.8 < dripped < 2
    assert r.xlen(f"redbatch:requests:{STUCK}") == 0, "nothing of it was enqueued"


# --- (9) /v1/models from the registry ----------------------------------------------------------


def test_models_come_from_the_registry_without_scan(r: redis.Redis, worker_factory: Any,
                                                    gateway_factory: Any) -> None:  # noqa: F811
    now_ms = int(time.time() * 1000)
    r.hset("redbatch:models", mapping={  # entries without a live worker are not listed
        "ghost": json.dumps({"seen_ms": now_ms}),  # no workers hash at all
        "gone": json.dumps({"seen_ms": now_ms - 3_600_000}),
        "stale": json.dumps({"seen_ms": now_ms})})
    r.hset("redbatch:workers:stale", "w", json.dumps({"seen_ms": now_ms - 3_600_000}))
    r.hset("redbatch:workers:gone", "w", json.dumps({"seen_ms": now_ms}))
    live_but_silent(r, "unregistered")  # a live consumer, but no worker announced it
    with worker_factory(model="echo"), gateway_factory(model_cache_s=0) as base_url:
        entry = json.loads(r.hget("redbatch:models", "echo") or "{}")
        r.config_resetstat()
        listed = [httpx.get(f"{base_url}/v1/models").json() for _ in range(3)]
        retrieved = httpx.get(f"{base_url}/v1/models/echo")
        stats = r.info("commandstats")
    assert entry["kind"] == "embedding" and entry["seen_ms"] >= now_ms - 60_000
    assert all([m["id"] for m in answer["data"]] == ["echo"] for answer in listed), listed
    assert retrieved.status_code == 200 and retrieved.json()["id"] == "echo"
    assert "cmdstat_scan" not in stats, sorted(stats)
    assert "cmdstat_hgetall" in stats


# --- (15) fixed messages for Redis failures ----------------------------------------------------


def test_a_wrong_typed_key_is_a_fixed_503(r: redis.Redis, gateway_factory: Any) -> None:  # noqa: F811
    """A Redis error is a fixed 503; a squatted workers hash or registry reads as empty (so
    one squatted key does not take every model's listing down), never as raw Redis text."""
    live_but_silent(r, "typed")
    r.set("redbatch:requests:other", "not a stream")
    r.set("redbatch:workers:typed", "not a hash")
    with gateway_factory() as base_url:
        failed = embed(base_url, "other")
        squatted = embed(base_url, "typed")
        r.set("redbatch:models", "not a hash either")
        listed = httpx.get(f"{base_url}/v1/models")
    assert failed.status_code in (404, 503) and not any(leak in failed.text for leak in LEAKS)
    assert squatted.status_code == 503 and not any(leak in squatted.text for leak in LEAKS)
    assert listed.status_code == 200 and listed.json()["data"] == []


def test_a_stopped_redis_is_a_fixed_503() -> None:
    with running_gateway(f"redis://127.0.0.1:{free_port()}/0") as base_url:
        embedded = embed(base_url, "any")
        listed = httpx.get(f"{base_url}/v1/models")
        ready = httpx.get(f"{base_url}/readyz")
    assert_fixed_message(embedded)
    assert_fixed_message(listed)
    assert ready.status_code == 503
    assert ready.json() == {"ok": False, "error": "the queue is unavailable; retry later"}


# --- (12) the bind ------------------------------------------------------------------------------


def test_an_open_bind_without_keys_is_refused_at_start(redis_url: str) -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "producer", "serve", "--host", "0.0.0.0",
                           "--port", str(free_port()), "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and time.monotonic() - started < 30
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0 with no api_keys" in lines[0]


def test_bind_defaults_and_the_explicit_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDBATCH_HOST", "REDBATCH_API_KEYS", "REDBATCH_ALLOW_UNAUTHENTICATED"):
        monkeypatch.delenv(name, raising=False)
    assert load_gateway_settings().host == "127.0.0.1"
    assert bind_refusal(load_gateway_settings()) is None
    assert bind_refusal(load_gateway_settings(host="::1")) is None
    assert bind_refusal(load_gateway_settings(host="0.0.0.0", api_keys="k")) is None
    assert bind_refusal(load_gateway_settings(host="gateway.example")) is not None
    with capture_logs() as logs:
        assert bind_refusal(load_gateway_settings(host="0.0.0.0",
                                                  allow_unauthenticated=True)) is None
    assert [entry["event"] for entry in logs] == ["gateway.unauthenticated"]
    assert logs[0]["log_level"] == "warning"
