"""The Python clients on a generative model (issue 33): infer and result return the final
answer, stream() yields the text then the result and survives a killed connection, models()
lists the models with a live worker. A real Redis, real workers (echo and the tiny LM)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import AsyncClient, Client, RequestFailed
from producer.liveness import Kind
from producer.models import LiveModel
from tests.rigs.tiny_lm import build_tiny_lm

PROMPT = {"prompt": "hello there", "max_new_tokens": 8}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-client"))


@pytest.fixture
def lm(worker_factory: Callable[..., Any], tiny_path: Path) -> Iterator[Any]:
    options = {"path": str(tiny_path), "max_new_tokens": 16, "max_new_tokens_limit": 64}
    with worker_factory(model="causal_lm", model_options=options) as worker:
        yield worker


def test_infer_and_result_on_a_generative_model_return_the_final_answer(
        redis_url: str, r: redis.Redis, lm: Any) -> None:
    client = Client(redis_url, "causal_lm")
    answer = client.infer(PROMPT, timeout=30)
    assert answer["finish_reason"] == "length" and answer["tokens"] == 8
    assert client.kind.generative is True
    # an explicit "stream": true: result() reads the token stream to its end
    request_id = client.submit({**PROMPT, "stream": True})
    assert client.result(request_id, timeout=30)["text"] == answer["text"]
    assert not r.exists(f"redbatch:reply:{request_id}")


def test_stream_yields_the_text_then_the_result(redis_url: str, lm: Any) -> None:
    client = Client(redis_url, "causal_lm")
    *texts, final = list(client.stream(PROMPT, timeout=30))
    assert texts and all(isinstance(t, str) for t in texts)
    assert "".join(texts) == final["text"] and final["tokens"] == 8
    with pytest.raises(RequestFailed, match="invalid_request"):
        list(client.stream({"prompt": 7}, timeout=30))


def test_stream_reads_on_after_its_connection_is_killed(
        redis_url: str, r: redis.Redis, lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("producer.streaming.READ_COUNT", 1)  # one chunk per XREAD
    client = Client(redis_url, "causal_lm")
    chunks = client.stream({**PROMPT, "max_new_tokens": 16}, timeout=30)
    first = next(chunks)
    assert r.client_kill_filter(_id=client.redis.client_id()) == 1
    *rest, final = list(chunks)
    assert first + "".join(rest) == final["text"] and final["tokens"] == 16


def test_stream_drops_a_foreign_chunk(redis_url: str, r: redis.Redis, lm: Any) -> None:
    client = Client(redis_url, "causal_lm")
    request_id = client.submit({**PROMPT, "stream": True})
    r.xadd(f"redbatch:stream:{request_id}",  # lands before or among the worker's entries
           {"data": json.dumps({"id": "other", "type": "done", "ok": True, "result": 1})},
           id="0-5")
    assert client.result(request_id, timeout=30)["tokens"] == 8


def test_async_stream_and_infer(redis_url: str, lm: Any) -> None:
    async def run() -> tuple[list[Any], Any]:
        client = AsyncClient(redis_url, "causal_lm")
        try:
            chunks = [chunk async for chunk in client.stream(PROMPT, timeout=30)]
            return chunks, await client.infer(PROMPT, timeout=30)
        finally:
            await client.close()

    (*texts, final), answer = asyncio.run(run())
    assert "".join(texts) == final["text"] == answer["text"]


def test_models_lists_the_models_with_a_live_worker(
        redis_url: str, r: redis.Redis, worker_factory: Callable[..., Any], lm: Any) -> None:
    client = Client(redis_url, "echo")
    with worker_factory(model="echo"):
        found = client.models()
        assert found == {"causal_lm": LiveModel("causal_lm", Kind.GENERATIVE, 1),
                         "echo": LiveModel("echo", Kind.EMBEDDING, 1)}
        assert found["causal_lm"].kind == "generative"
    # a worker that stopped cleanly took its entry with it; one that died left a stale one
    stale = json.dumps({"seen_ms": int(time.time() * 1000) - 60_000, "generative": False})
    r.hset("redbatch:workers:echo", "died-long-ago", stale)
    assert set(client.models()) == {"causal_lm"}

    async def listed() -> set[str]:
        async_client = AsyncClient(redis_url, "echo")
        try:
            return set(await async_client.models())
        finally:
            await async_client.close()

    assert asyncio.run(listed()) == {"causal_lm"}


def test_async_stream_reads_on_after_its_connection_is_killed(
        redis_url: str, r: redis.Redis, lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("producer.streaming.READ_COUNT", 1)

    async def run() -> tuple[list[str], Any]:
        client = AsyncClient(redis_url, "causal_lm")
        try:
            chunks = client.stream({**PROMPT, "max_new_tokens": 16}, timeout=30)
            texts = [await anext(chunks)]
            assert r.client_kill_filter(_id=await client.redis.client_id()) == 1
            rest = [chunk async for chunk in chunks]
            return texts + rest[:-1], rest[-1]
        finally:
            await client.close()

    texts, final = asyncio.run(run())
    assert "".join(texts) == final["text"] and final["tokens"] == 16


def test_a_client_that_reads_streams_itself_keeps_few_ids(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway submits "stream": true and reads the stream itself: the ids the client
    keeps for wait() stay bounded."""
    monkeypatch.setattr("producer.request_base.REMEMBERED_REPLY_KEYS", 3)
    client = Client(redis_url, "causal_lm")
    client.kind.learn({"w": json.dumps({"generative": True})}, None)
    for n in range(10):
        client.submit({"prompt": str(n), "stream": True})
    assert len(client._streamed) == 3


def test_a_shared_list_reply_key_gets_final_answers(redis_url: str, lm: Any) -> None:
    """A generative request with a list reply_to is sent `"stream": false`: its answer lands
    on the list, where collect() waits (not a WRONGTYPE stream write on a list)."""
    client = Client(redis_url, "causal_lm")
    reply_to = client.new_reply_key()
    ids = client.submit_many([PROMPT, PROMPT], reply_to=reply_to)
    envelopes = client.collect(reply_to, 2, timeout=30, ids=set(ids))
    assert sorted(e["id"] for e in envelopes) == sorted(ids)
    assert all(e["ok"] and e["result"]["tokens"] == 8 for e in envelopes)
