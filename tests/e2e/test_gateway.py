"""The OpenAI-compatible gateway end to end: uvicorn on a free port in a background thread,
a real worker, a real Redis, and the official `openai` SDKs (Python, and Node.js) as clients.
Raw HTTP cases (bad bodies, error statuses) go through httpx."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import uvicorn

from producer import Client, connection
from producer.gateway.app import create_app
from producer.gateway.openai_shapes import decode_base64_embedding
from producer.gateway.serve import server_options
from producer.gateway.settings import load_gateway_settings
from tests.rigs.node import npm_installed
from tests.rigs.paths import REPO_ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXAMPLE = REPO_ROOT / "examples" / "node-openai"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Redis streams batch requests.",
         "ünïcode and tabs\there"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_gateway(redis_url: str, **overrides: Any) -> Iterator[str]:
    """The gateway served by uvicorn in a thread until the block ends, with the options of
    `python -m producer serve` (its HTTP protocol); yields its base URL."""
    port = free_port()
    settings = load_gateway_settings(**{"redis_url": redis_url, "host": "127.0.0.1",
                                        "port": port, "log_level": "warning", **overrides})
    server = uvicorn.Server(uvicorn.Config(create_app(settings), lifespan="on",
                                           **server_options(settings)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def gateway_factory(redis_url: str) -> Callable[..., Any]:
    """gateway_factory(**settings) -> context manager yielding the gateway's base URL."""
    return lambda **overrides: running_gateway(redis_url, **overrides)


def sdk(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0,
                         timeout=30)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def assert_openai_error(response: httpx.Response, status: int,
                        code: str | None = None) -> dict[str, Any]:
    """The status, and OpenAI's error shape {"error": {message, type, param, code}}."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def post(base_url: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json=body, timeout=30, **kwargs)


# --- the happy path ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_equal_the_direct_protocol(redis_url: str, worker_factory: Any,
                                              gateway_factory: Any,
                                              encoding_format: str) -> None:
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        response = sdk(base_url).embeddings.create(model="minilm", input=TEXTS,
                                                   encoding_format=encoding_format)
        direct = Client(redis_url, "minilm")
        expected = [direct.infer({"text": text}, timeout=30) for text in TEXTS]
        direct.close()
    assert response.object == "list" and response.model == "minilm"
    assert [item.index for item in response.data] == [0, 1, 2]
    for item, want in zip(response.data, expected, strict=True):
        got = item.embedding
        if isinstance(got, str):  # the SDK hands base64 back undecoded when asked for it
            got = decode_base64_embedding(got)
        assert len(got) == 384 and cosine(got, want["embedding"]) >= 0.9999
    tokens = sum(want["tokens"] for want in expected)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_base64_raw_bytes_are_little_endian_float32(redis_url: str, worker_factory: Any,
                                                    gateway_factory: Any) -> None:
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        raw = post(base_url, {"model": "minilm", "input": "hello", "encoding_format": "base64",
                              "dimensions": 384, "user": "someone"})
        plain = post(base_url, {"model": "minilm", "input": "hello"})
    assert raw.status_code == 200 and plain.status_code == 200, raw.text + plain.text
    decoded = decode_base64_embedding(raw.json()["data"][0]["embedding"])
    floats = plain.json()["data"][0]["embedding"]
    assert len(decoded) == 384 and max(abs(a - b) for a, b in zip(decoded, floats,
                                                                 strict=True)) < 1e-6


def test_models_lists_models_with_live_workers(r: redis.Redis, worker_factory: Any,
                                               gateway_factory: Any) -> None:
    r.xgroup_create("redbatch:requests:orphan", "workers", id="0", mkstream=True)
    with worker_factory(model="echo"), gateway_factory() as base_url:
        models = sdk(base_url).models.list()
        raw = httpx.get(f"{base_url}/v1/models").json()
    assert [m.id for m in models.data] == ["echo"]
    assert raw["object"] == "list"
    assert raw["data"][0]["object"] == "model" and raw["data"][0]["owned_by"] == "redbatch"
    assert isinstance(raw["data"][0]["created"], int)
    assert raw["data"][0]["created"] > 1_700_000_000  # its worker's start, not 0
    assert raw["data"][0]["kind"] == "embedding", "what its worker announces: the route to use"


def test_models_retrieve_one_model(worker_factory: Any, gateway_factory: Any) -> None:
    with worker_factory(model="echo"), gateway_factory() as base_url:
        model = sdk(base_url).models.retrieve("echo")
        missing = httpx.get(f"{base_url}/v1/models/nope")
    assert (model.id, model.object, model.owned_by) == ("echo", "model", "redbatch")
    assert model.model_dump()["kind"] == "embedding"
    assert_openai_error(missing, 404, "model_not_found")


def test_probes_and_metrics(gateway_factory: Any) -> None:
    with gateway_factory() as base_url:
        assert httpx.get(f"{base_url}/healthz").json() == {"ok": True}
        assert httpx.get(f"{base_url}/readyz").json() == {"ok": True}
        httpx.get(f"{base_url}/no/such/route")
        text = httpx.get(f"{base_url}/metrics").text
    assert 'redbatch_gateway_requests_total{route="/healthz",status="200"}' in text
    assert 'redbatch_gateway_requests_total{route="other",status="404"}' in text
    assert "redbatch_gateway_request_seconds_bucket" in text


def test_readyz_fails_without_redis() -> None:
    with running_gateway(f"redis://127.0.0.1:{free_port()}/0") as base_url:
        assert httpx.get(f"{base_url}/healthz").status_code == 200
        assert httpx.get(f"{base_url}/readyz").status_code == 503


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"model": "echo", "input": [1, 2, 3]}, "input"),
    ({"model": "echo", "input": [[1, 2], [3]]}, "input"),
    ({"model": "echo", "input": []}, "input"),
    ({"model": "echo", "input": ["ok", 5.5]}, "input"),
    ({"model": "echo"}, "input"),
    ({"input": "x"}, "model"),
    ({"model": "echo", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "echo", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "echo", "input": "x", "temperature": 1}, "temperature"),
    (["not", "an", "object"], None),
], ids=["token-ids", "token-id-lists", "empty-list", "not-a-string", "no-input", "no-model",
        "bad-format", "bad-dimensions", "unknown-field", "not-an-object"])
def test_invalid_requests_are_400(worker_factory: Any, gateway_factory: Any, body: Any,
                                  param: str | None) -> None:
    with worker_factory(model="echo"), gateway_factory() as base_url:
        error = assert_openai_error(post(base_url, body), 400)
        assert error["param"] == param and error["type"] == "invalid_request_error"


def test_worker_errors_and_dimensions(worker_factory: Any, gateway_factory: Any) -> None:
    """`dimensions` other than the model's size is refused, checked on the worker's answer."""
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        error = assert_openai_error(post(base_url, {"model": "minilm", "input": "x",
                                                    "dimensions": 256}), 400,
                                    "unsupported_dimensions")
        assert error["param"] == "dimensions"
        with pytest.raises(openai.BadRequestError):
            sdk(base_url).embeddings.create(model="minilm", input="x", dimensions=128)


def test_echo_is_not_an_embedding_model(worker_factory: Any, gateway_factory: Any) -> None:
    with worker_factory(model="echo"), gateway_factory() as base_url:
        assert_openai_error(post(base_url, {"model": "echo", "input": "x"}), 500,
                            "not_an_embedding_model")


def test_a_generation_route_on_a_batch_model_is_400_at_once(worker_factory: Any,
                                                            gateway_factory: Any) -> None:
    """The workers announce their kind: no request is queued for a reply nobody reads."""
    with worker_factory(model="echo"), gateway_factory() as base_url:
        for stream in (True, False):
            started = time.monotonic()
            response = httpx.post(f"{base_url}/v1/completions", json={
                "model": "echo", "prompt": "hi", "max_tokens": 4, "stream": stream}, timeout=30)
            error = assert_openai_error(response, 400, "wrong_model_kind")
            assert "use /v1/embeddings" in error["message"] and error["param"] == "model"
            assert time.monotonic() - started < 5


def test_a_worker_that_reads_nothing_is_still_live(r: redis.Redis, redis_url: str) -> None:
    """Before Redis 7.2, XINFO CONSUMERS' idle grows while a consumer's reads deliver
    nothing; the `seen_ms` a worker announces every maintenance round keeps it live."""
    from producer.gateway.discovery import Discovery, ModelState

    stream = "redbatch:requests:quiet"
    r.xgroup_create(stream, "workers", id="0", mkstream=True)
    r.xreadgroup("workers", "w1", {stream: ">"}, count=1, block=10)  # the consumer exists
    time.sleep(0.2)

    async def state() -> ModelState:
        client = connection.async_client(redis_url)
        try:
            return (await Discovery(client, "redbatch", "workers", 0.1, 0.0).info("quiet")).state
        finally:
            await client.aclose()

    assert asyncio.run(state()) is ModelState.NO_WORKER
    now_ms = int(time.time() * 1000)
    r.hset("redbatch:workers:quiet", "w1", json.dumps({"seen_ms": now_ms, "generative": False}))
    assert asyncio.run(state()) is ModelState.LIVE
    r.hset("redbatch:workers:quiet", "w1", json.dumps({"seen_ms": now_ms - 1000}))
    assert asyncio.run(state()) is ModelState.NO_WORKER


def test_api_keys(worker_factory: Any, gateway_factory: Any) -> None:
    with worker_factory(model="minilm"), gateway_factory(api_keys="k1,k2") as base_url:
        assert_openai_error(post(base_url, {"model": "minilm", "input": "x"}), 401,
                            "invalid_api_key")
        assert_openai_error(post(base_url, {"model": "minilm", "input": "x"},
                                 headers={"Authorization": "Bearer wrong"}), 401)
        assert_openai_error(httpx.get(f"{base_url}/v1/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            sdk(base_url, "wrong").embeddings.create(model="minilm", input="x")
        done = sdk(base_url, "k2").embeddings.create(model="minilm", input="x")
        assert len(done.data[0].embedding) == 384
        assert httpx.get(f"{base_url}/healthz").status_code == 200  # probes stay open


def test_unknown_model_and_route_are_404(worker_factory: Any, gateway_factory: Any) -> None:
    with worker_factory(model="echo"), gateway_factory() as base_url:
        error = assert_openai_error(post(base_url, {"model": "nope", "input": "x"}), 404,
                                    "model_not_found")
        assert error["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            sdk(base_url).embeddings.create(model="nope", input="x")
        assert_openai_error(httpx.get(f"{base_url}/v1/audio/speech"), 404, "not_found")
        assert_openai_error(httpx.get(f"{base_url}/v1/chat/completions"), 405)
        assert_openai_error(httpx.get(f"{base_url}/v1/embeddings"), 405)


def test_no_live_worker_is_503(r: redis.Redis, gateway_factory: Any) -> None:
    r.xgroup_create("redbatch:requests:idle", "workers", id="0", mkstream=True)
    with gateway_factory() as base_url:
        response = post(base_url, {"model": "idle", "input": "x"})
    assert_openai_error(response, 503, "no_live_worker")
    assert response.headers["Retry-After"]


def test_backlog_is_429_with_retry_after(r: redis.Redis, gateway_factory: Any) -> None:
    """A live consumer that reads one entry and answers none: the rest stays queued."""
    stream = "redbatch:requests:stuck"
    r.xgroup_create(stream, "workers", id="0", mkstream=True)
    for index in range(5):
        r.xadd(stream, {"id": f"old-{index}", "payload": b"\x80"})
    r.xreadgroup("workers", "slow-consumer", {stream: ">"}, count=1)
    with gateway_factory(max_backlog=3) as base_url:
        response = post(base_url, {"model": "stuck", "input": ["a", "b"]})
        with pytest.raises(openai.RateLimitError):
            sdk(base_url).embeddings.create(model="stuck", input="a")
    assert_openai_error(response, 429, "overloaded")
    assert int(response.headers["Retry-After"]) >= 1
    assert r.xlen(stream) == 5, "nothing of a refused call is enqueued"


def test_timeout_is_504(r: redis.Redis, worker_factory: Any, gateway_factory: Any) -> None:
    # the answer takes 2 s or more (slept), the gateway gives up at 0.2 s: no race
    with worker_factory(model="echo", model_options={"delay_ms": 2000}), \
            gateway_factory(request_timeout_s=0.2) as base_url:
        started = time.monotonic()
        response = post(base_url, {"model": "echo", "input": ["slow", "slower"]})
        assert time.monotonic() - started < 1.9  # before the answer could have come
        with pytest.raises(openai.APIStatusError) as raised:
            sdk(base_url).embeddings.create(model="echo", input="x")
        assert raised.value.status_code == 504
    assert_openai_error(response, 504, "timeout")
    deadline = int(r.xrange("redbatch:requests:echo", count=1)[0][1][b"deadline_ms"])
    assert abs(deadline / 1000 - time.time()) < 60, "deadline_ms is absolute Unix ms"


def test_bad_http_input_then_still_serving(worker_factory: Any, gateway_factory: Any) -> None:
    with worker_factory(model="minilm"), gateway_factory(max_body_bytes=10_000) as base_url:
        url = f"{base_url}/v1/embeddings"
        headers = {"Content-Type": "application/json"}
        assert_openai_error(httpx.post(url, content=b'{"model": "minilm", "inp',
                                       headers=headers), 400, "invalid_json")
        assert_openai_error(httpx.post(url, content=b"\xff\xfe", headers=headers), 400,
                            "invalid_json")
        assert_openai_error(httpx.post(url, content=b"[" * 5000,
                                       headers=headers), 400)
        assert_openai_error(httpx.post(url, content=b"model=minilm",
                                       headers={"Content-Type": "text/plain"}), 415)
        assert_openai_error(httpx.post(url, content=b"{}"), 415)
        huge = json.dumps({"model": "minilm", "input": "word " * 10_000}).encode()
        assert_openai_error(httpx.post(url, content=huge, headers=headers), 413,
                            "body_too_large")
        chunks = (b'{"input": "' + b"x" * 4096 for _ in range(5))  # no Content-Length
        assert_openai_error(httpx.post(url, content=chunks, headers=headers), 413)
        assert_openai_error(httpx.delete(url), 405)
        assert_openai_error(httpx.get(f"{base_url}/nothing/here"), 404)
        assert_openai_error(post(base_url, {"model": "minilm", "input": []}), 400)
        done = sdk(base_url).embeddings.create(model="minilm", input=["still", "serving"])
        assert [len(item.embedding) for item in done.data] == [384, 384]


def test_an_input_over_the_workers_payload_limit_is_413(worker_factory: Any,
                                                         gateway_factory: Any) -> None:
    """The worker answers invalid_request with reason payload_too_large: the gateway, which
    does not know the worker's max_payload_bytes, answers 413 as for its own body limit."""
    with worker_factory(model="minilm", max_payload_bytes=64), gateway_factory() as base_url:
        error = assert_openai_error(post(base_url, {"model": "minilm", "input": "long " * 40}),
                                    413, "payload_too_large")
    assert error["message"].startswith("worker: ") and error["param"] == "input"
    assert "above the limit of 64" in error["message"]


# --- Node.js: the official openai package -----------------------------------------------------


@pytest.fixture(scope="session")
def node_openai() -> Path:
    """examples/node-openai with its packages installed (`npm ci` from the lock file)."""
    return npm_installed(EXAMPLE, EXAMPLE / "node_modules" / "openai")


def test_node_openai_client(worker_factory: Any, gateway_factory: Any,
                            node_openai: Path) -> None:
    with worker_factory(model="minilm"), gateway_factory(api_keys="node-key") as base_url:
        done = subprocess.run(["node", "embeddings.mjs", *TEXTS[:2]], cwd=node_openai,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "OPENAI_BASE_URL": f"{base_url}/v1",
                                   "OPENAI_API_KEY": "node-key", "MODEL": "minilm"})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == "minilm" and len(result["data"]) == 2
    for item in result["data"]:
        vector = item["embedding"]
        assert len(vector) == 384 and all(math.isfinite(x) for x in vector)
        assert abs(math.sqrt(sum(x * x for x in vector)) - 1) < 1e-3
    assert result["usage"]["prompt_tokens"] > 0
