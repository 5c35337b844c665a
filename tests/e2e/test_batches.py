"""Batch jobs end to end: the official `openai` client through the Files and Batch APIs, a
real gateway (uvicorn in a thread, its batch runner in its lifespan), a real worker and a
real Redis. Polls are short: a batch of a few lines finishes in about a second."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from producer.batches import keys
from tests.e2e.test_gateway import running_gateway, sdk
from tests.rigs.chaos import heaviest_on_redis_7_only
from tests.rigs.paths import REPO_ROOT
from worker.commands.stats import read_batches, to_json

TEXTS = ["The quick brown fox.", "Redis streams batch requests.", "ünïcode", "a" * 300]


@pytest.fixture
def gateway_factory(redis_url: str) -> Callable[..., Any]:
    return lambda **overrides: running_gateway(redis_url, **overrides)


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def embedding_lines(count: int, model: str = "minilm") -> list[dict[str, Any]]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": model, "input": TEXTS[i % len(TEXTS)]}} for i in range(count)]


def upload(client: openai.OpenAI, rows: list[dict[str, Any]] | bytes) -> str:
    data = rows if isinstance(rows, bytes) else jsonl(rows)
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_an_embeddings_batch_runs_through_the_openai_client(worker_factory: Any,
                                                            gateway_factory: Any) -> None:
    rows = embedding_lines(9)
    rows[4]["body"]["input"] = ["two", "inputs"]  # a line of two requests
    rows[5]["body"]["input"] = []  # the route refuses it: an error line, not a failed batch
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        client = sdk(base_url)
        file_id = upload(client, rows)
        assert client.files.retrieve(file_id).bytes == len(jsonl(rows))
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                      completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.output_file_id is None
        done = wait_final(client, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (9, 8, 1)
        assert done.metadata == {"job": "nightly"} and done.completed_at is not None
        output, errors = lines_of(client, done.output_file_id), lines_of(
            client, done.error_file_id)
        assert {o["custom_id"] for o in output} == {f"line-{i}" for i in range(9)} - {"line-5"}
        two = next(o for o in output if o["custom_id"] == "line-4")["response"]["body"]
        assert [d["index"] for d in two["data"]] == [0, 1] and len(two["data"][0]["embedding"]) \
            == 384
        assert [e["custom_id"] for e in errors] == ["line-5"]
        assert errors[0]["response"]["status_code"] == 400
        assert client.batches.list().data[0].id == batch.id
        assert file_id in [f.id for f in client.files.list()]


def test_a_file_that_fails_validation_is_a_failed_batch_with_its_errors(
        worker_factory: Any, gateway_factory: Any) -> None:
    rows = embedding_lines(3)
    rows[1]["custom_id"] = "line-0"
    rows[2]["body"]["model"] = "other"
    bad = jsonl(rows) + b"{not json\n"
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        client = sdk(base_url)
        batch = client.batches.create(input_file_id=upload(client, bad),
                                      endpoint="/v1/embeddings", completion_window="24h")
        done = wait_final(client, batch.id)
        assert done.status == "failed" and done.failed_at is not None
        assert done.errors is not None and done.errors.data is not None
        codes = {(e.code, e.line) for e in done.errors.data}
        assert codes == {("duplicate_custom_id", 2), ("mismatched_model", 3),
                         ("invalid_json", 4)}
        unknown = client.batches.create(input_file_id=upload(client, embedding_lines(1, "nope")),
                                        endpoint="/v1/embeddings", completion_window="24h")
        failed = wait_final(client, unknown.id)
        assert failed.errors is not None and failed.errors.data is not None
        assert [e.code for e in failed.errors.data] == ["model_not_found"]


def test_cancel_keeps_the_answered_lines_and_writes_the_rest_cancelled(
        redis_url: str, gateway_factory: Any) -> None:
    """No worker serves the model (its group exists): nothing is answered, all cancelled."""
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create("redbatch:requests:minilm", "workers", mkstream=True)
    with gateway_factory() as base_url:
        client = sdk(base_url)
        batch = client.batches.create(input_file_id=upload(client, embedding_lines(5)),
                                      endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 10
        while client.batches.retrieve(batch.id).status != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # a step of the runner: its rate is measured
        scraped = httpx.get(f"{base_url}/metrics").text
        assert f'redbatch_gateway_batch_lines_per_second{{batch="{batch.id}"}}' in scraped
        assert "redbatch_gateway_batches_running 1.0" in scraped
        shown = to_json([], read_batches(r, "redbatch"))["batches"]
        assert [(b["id"], b["status"], b["total"]) for b in shown] == [
            (batch.id, "in_progress", 5)]
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = wait_final(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        errors = lines_of(client, done.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == [f"line-{i}" for i in range(5)]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert all(e["response"] is None for e in errors)


def test_idempotency_key_returns_the_first_batch(gateway_factory: Any, redis_url: str) -> None:
    redis.Redis.from_url(redis_url).xgroup_create("redbatch:requests:minilm", "workers",
                                                  mkstream=True)
    with gateway_factory(batch_runner=False) as base_url:
        client = sdk(base_url)
        file_id = upload(client, embedding_lines(2))
        first, again = (client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h",
            extra_headers={"Idempotency-Key": "job-7"}) for _ in range(2))
        assert first.id == again.id
        other = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                      completion_window="24h")
        assert other.id != first.id


def test_hostile_requests_get_openai_errors(gateway_factory: Any, redis_url: str) -> None:
    with gateway_factory(batch_runner=False, batch_max_file_bytes=1000,
                         api_keys="key-a,key-b") as base_url:
        a, b = sdk(base_url, "key-a"), sdk(base_url, "key-b")
        file_id = upload(a, embedding_lines(2))
        with pytest.raises(openai.NotFoundError):
            b.files.retrieve(file_id)  # another key's file
        with pytest.raises(openai.NotFoundError):
            b.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                             completion_window="24h")
        assert b.files.list().data == [] and b.batches.list().data == []
        with pytest.raises(openai.BadRequestError) as big:
            upload(a, b"x" * 2000)
        assert big.value.code == "file_too_large"
        for body, param in [({"input_file_id": file_id, "endpoint": "/v1/nope",
                              "completion_window": "24h"}, "endpoint"),
                            ({"input_file_id": file_id, "endpoint": "/v1/embeddings",
                              "completion_window": "48h"}, "completion_window")]:
            answer = httpx.post(f"{base_url}/v1/batches", json=body,
                                headers={"Authorization": "Bearer key-a"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param
        with pytest.raises(openai.NotFoundError):
            a.batches.retrieve("batch_" + "0" * 24)
        with pytest.raises(openai.NotFoundError):
            a.files.retrieve("../../etc")
        assert httpx.get(f"{base_url}/v1/files").status_code == 401
        # LiteLLM's detection of a server that runs batches itself: GET /v1/files is 200
        listed = httpx.get(f"{base_url}/v1/files", headers={"Authorization": "Bearer key-a"})
        assert listed.status_code == 200 and listed.json()["object"] == "list"
        assert keys.is_file_id(file_id)


def test_chat_and_completion_lines_run_on_a_generative_model(
        worker_factory: Any, gateway_factory: Any, tmp_path: Any) -> None:
    from tests.rigs.tiny_lm import build_tiny_lm

    options = {"path": str(build_tiny_lm(tmp_path)), "max_new_tokens": 8}
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "causal_lm", "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "user", "content": f"question {i}"}]}}
            for i in range(4)]
    chat[3]["body"]["stream"] = True  # refused, as a batch line: an error line
    with worker_factory(model="causal_lm", model_options=options), \
            gateway_factory() as base_url:
        client = sdk(base_url)
        batch = client.batches.create(input_file_id=upload(client, chat),
                                      endpoint="/v1/chat/completions", completion_window="1h")
        done = wait_final(client, batch.id)
        online = client.chat.completions.create(model="causal_lm", max_tokens=6,
                                                temperature=0, messages=chat[0]["body"][
                                                    "messages"])
        output = {o["custom_id"]: o["response"]["body"]
                  for o in lines_of(client, done.output_file_id)}
        errors = lines_of(client, done.error_file_id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    assert output["chat-0"]["object"] == "chat.completion"
    assert output["chat-0"]["choices"][0]["message"]["content"] == \
        online.choices[0].message.content  # greedy: the same answer as online
    assert [e["custom_id"] for e in errors] == ["chat-3"]


def test_lines_not_done_by_the_completion_window_expire(redis_url: str,
                                                        gateway_factory: Any) -> None:
    redis.Redis.from_url(redis_url).xgroup_create("redbatch:requests:minilm", "workers",
                                                  mkstream=True)
    with gateway_factory() as base_url:
        client = sdk(base_url)
        batch = client.batches.create(input_file_id=upload(client, embedding_lines(3)),
                                      endpoint="/v1/embeddings", completion_window="1s")
        done = wait_final(client, batch.id, timeout_s=20)
        errors = lines_of(client, done.error_file_id)
    assert done.status == "expired" and done.expired_at is not None
    assert done.output_file_id is None
    assert sorted(e["custom_id"] for e in errors) == ["line-0", "line-1", "line-2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_lines_the_worker_sheds_are_sent_again_never_answered_overloaded(
        r: redis.Redis, redis_url: str, worker_factory: Any, gateway_factory: Any) -> None:
    """An echo worker costing 100 ms a batch of 2, shedding over a 400 ms target, refuses
    most of a 20-line window at read time: the refused lines are deferred and sent again
    until each is answered once. (Echo is no embedding model, so each answer is the route's
    500; what matters here is that none is `overloaded`.)"""
    from producer import Client

    heaviest_on_redis_7_only(r)  # seconds of shedding: the runner's path, not the engine's
    with worker_factory(model="echo", model_options={"delay_ms": 100}, max_batch_size=2,
                        instances=1, latency_target_ms=400.0, shed_over_target=True), \
            gateway_factory(batch_max_backlog=20, batch_window=20) as base_url:
        warm = Client(redis_url, "echo")
        for request_id in warm.submit_many([{"n": i} for i in range(6)]):
            warm.wait(request_id, timeout=30)  # the worker learns what a batch costs
        client = sdk(base_url)
        done = wait_final(client, client.batches.create(
            input_file_id=upload(client, embedding_lines(20, "echo")),
            endpoint="/v1/embeddings", completion_window="24h").id, timeout_s=90)
        errors = lines_of(client, done.error_file_id)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.failed == 20 and len({e["custom_id"] for e in errors}) == 20
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"unexpected_result"}
    attempts = [keys.parse_request_id(e["response"]["request_id"]) for e in errors]
    assert max(found[1] for found in attempts if found) > 1  # some were shed, then sent again


def test_the_readmes_batch_example_runs_as_written(worker_factory: Any, gateway_factory: Any,
                                                   tmp_path: Any, monkeypatch: Any) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("Batch jobs (OpenAI's Files and Batch APIs"):]
    start = section.index("```python\n") + len("```python\n")
    example = section[start:section.index("```", start)]
    (tmp_path / "in.jsonl").write_bytes(jsonl(embedding_lines(3)))
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []
    with worker_factory(model="minilm"), gateway_factory() as base_url:
        exec(example, {"client": sdk(base_url), "time": time, "print": printed.append})
    assert sorted(json.loads(line)["custom_id"] for line in printed[0].splitlines()) == [
        "line-0", "line-1", "line-2"]
