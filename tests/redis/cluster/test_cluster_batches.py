"""Batch jobs on a real Redis Cluster (tests/rigs/cluster.py, 3 masters + 3 replicas): a
gateway process (`python -m producer serve --redis-cluster true`) runs a 300-line embeddings
batch to `completed` (and an online embeddings call beside it) and a second one cancelled
mid-way (its lines in flight get cancel keys across slots), through the official `openai`
client; a batch created with the plain-Redis commands of docs/protocol.md is run by `python
-m producer batches --redis-cluster`; `python -m producer batch run --redis-cluster` runs a
file end to end. Every line is answered exactly once, and a batch's keys share one slot.

The model is a tiny BERT encoder built offline (tests/rigs/tiny_encoders.py): echo serves no
/v1/embeddings. About 20 s, past the ~10 s aimed at: the cluster's start and the tiny
model's build (~10 s), two process starts (a gateway, the runner alone) and the batches
(~5 s together).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from producer import Client, connection
from producer.batches import keys, scripts
from producer.batches.store import BatchStore
from producer.shards import key_slot
from tests.e2e.test_gateway import free_port, sdk
from tests.rigs.cluster import ClusterRig, cluster, cluster_worker, rig
from tests.rigs.paths import REPO_ROOT
from tests.rigs.servers import wait_until
from tests.rigs.tiny_encoders import build_tiny_encoder

__all__ = ["cluster", "rig"]  # the fixtures, imported for pytest
MODEL = "encoder"
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's model options: a tiny encoder, untraced (tracing costs seconds)."""
    path = build_tiny_encoder(tmp_path_factory.mktemp("tiny") / "encoder")
    return {"path": str(path), "trace": False}


def rows(count: int, prefix: str) -> list[dict[str, Any]]:
    return [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": MODEL, "input": f"line {i} of {prefix}"}} for i in range(count)]


def jsonl(found: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in found)


def process(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "producer", *args], cwd=REPO_ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=out)


@contextmanager
def stopped_at_end(child: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield child
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextmanager
def gateway(url: str, log: Path) -> Iterator[str]:
    """A gateway process on the cluster; a small window, so a batch takes a second or two
    and can be cancelled mid-way."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    child = process(["serve", "--redis-url", url, "--redis-cluster", "true", "--port",
                     str(port), "--batch-window", "8", "--batch-max-backlog", "8",
                     "--batch-lease-s", "2", "--log-level", "warning"], log)

    def ready() -> bool:
        assert child.poll() is None, log.read_text()
        try:
            return httpx.get(f"{base}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    with stopped_at_end(child):
        wait_until(ready, 30, "the gateway did not start")
        yield base


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.05)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def one_slot(batch_id: str) -> None:
    """Every key of the batch that exists is in the batch's slot."""
    found = keys.BatchKeys("redbatch", batch_id).all()
    assert {key_slot(k) for k in found} == {key_slot(found[0])}


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return 0 if counts is None else counts.completed


def create(client: openai.OpenAI, found: list[dict[str, Any]]) -> str:
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(found))),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                 completion_window="24h").id


def test_batches_through_a_gateway_on_a_cluster(rig: ClusterRig, encoder: dict[str, Any],
                                                tmp_path: Path) -> None:
    url = rig.url()
    with cluster_worker(url, MODEL, model_options=encoder, max_batch_size=8), \
            gateway(url, tmp_path / "gateway.log") as base:
        client = sdk(base)
        done = wait_final(client, create(client, rows(300, "a")))
        assert done.status == "completed", done.errors
        output = lines_of(client, done.output_file_id)
        assert Counter(o["custom_id"] for o in output) == Counter(
            f"a-{i}" for i in range(300))  # every line exactly once
        assert all(o["response"]["status_code"] == 200 for o in output)
        assert done.error_file_id is None and client.batches.list().data[0].id == done.id
        one_slot(done.id)
        online = client.embeddings.create(model=MODEL, input=["online", "beside batches"])
        assert [e.index for e in online.data] == [0, 1]  # the online route on a cluster too
        assert client.files.list().data[0].id == done.input_file_id
        assert client.files.delete(done.input_file_id).deleted
        assert done.input_file_id not in [f.id for f in client.files.list()]
        cancelled = create(client, rows(1000, "b"))
        wait_until(lambda: completed(client, cancelled) >= 10, 30, "the second batch stood")
        assert client.batches.cancel(cancelled).status in ("cancelling", "cancelled")
        final = wait_final(client, cancelled)
        kept, errors = (lines_of(client, final.output_file_id),
                        lines_of(client, final.error_file_id))
    assert final.status == "cancelled" and final.cancelled_at is not None, final
    assert len(kept) >= 10 and errors, "cancelled mid-way: some lines done, some not"
    assert Counter(o["custom_id"] for o in kept + errors) == Counter(
        f"b-{i}" for i in range(1000))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert final.request_counts is not None
    assert (final.request_counts.completed, final.request_counts.failed) == (
        len(kept), len(errors))


def test_admission_weighs_the_backlog_of_every_shard(rig: ClusterRig) -> None:
    """With no worker, 12 requests spread over the model's 6 shards: a runner's backlog
    counts them all (the model's unsharded stream does not exist on a cluster)."""
    client = Client(rig.url(), "idle", cluster=True)
    client.submit_many([{"n": n} for n in range(12)])
    client.close()

    async def backlog() -> int:
        r = connection.async_client(rig.url(), cluster=True)
        try:
            return await BatchStore(r, "redbatch").backlog("idle", "workers", 100)
        finally:
            await r.aclose()

    assert asyncio.run(backlog()) == 12


def plain_redis_batch(r: redis.RedisCluster, count: int) -> str:
    """A file and a batch written with docs/protocol.md's commands, in its order."""
    file_id, batch_id, now_ms = keys.new_file_id(), keys.new_batch_id(), int(time.time() * 1000)
    now = now_ms // 1000
    r.hset(f"redbatch:file:{{{file_id}}}:lines",
           mapping={i: json.dumps(row) for i, row in enumerate(rows(count, "p"))})
    r.hset(f"redbatch:file:{{{file_id}}}", mapping={
        "id": file_id, "bytes": 1, "created_at": now, "created_ms": now_ms,
        "filename": "in.jsonl", "purpose": "batch", "owner": "public", "lines": count})
    r.zadd("redbatch:files:{public}", {file_id: now_ms})
    r.zadd("redbatch:batches:active", {batch_id: now_ms}, nx=True)
    meta: dict[str, str | int] = {"id": batch_id, "owner": "public", "endpoint": "/v1/embeddings",
            "input_file_id": file_id, "completion_window": "24h", "status": "validating",
            "created_at": now, "created_ms": now_ms, "expires_at": now + 86400, "total": 0,
            "completed": 0, "failed": 0, "metadata": ""}
    assert r.eval(scripts.CREATE, 1, f"redbatch:batch:{{{batch_id}}}",
                  *(part for pair in meta.items() for part in pair)) == 1
    r.zadd("redbatch:batches:{public}", {batch_id: now_ms})
    return batch_id


@pytest.mark.usefixtures("fresh_logs")  # the CLI logs to the captured stderr: restored after
def test_plain_redis_batch_and_the_cli_on_a_cluster(
        rig: ClusterRig, encoder: dict[str, Any], tmp_path: Path,
        capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    from producer.batches.cli import main

    url = rig.url()
    r = redis.RedisCluster.from_url(url)
    batch_id = plain_redis_batch(r, 50)
    (tmp_path / "in.jsonl").write_bytes(jsonl(rows(40, "c")))
    meta = f"redbatch:batch:{{{batch_id}}}"
    with cluster_worker(url, MODEL, model_options=encoder, max_batch_size=8):
        with stopped_at_end(process(["batches", "--redis-url", url, "--redis-cluster",
                                     "--log-level", "warning"], tmp_path / "runner.log")):
            wait_until(lambda: r.hget(meta, "status") in (b"completed", b"failed"), 60,
                       "the runner did not finish the plain-Redis batch")
        assert main(["--redis-url", url, "--redis-cluster", "run", "-i",
                     str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]) == 0
    assert r.hget(meta, "status") == b"completed", r.hgetall(meta)
    output = [json.loads(line) for line in r.lrange(f"{meta}:output", 0, -1)]
    assert Counter(o["custom_id"] for o in output) == Counter(f"p-{i}" for i in range(50))
    ran = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert Counter(o["custom_id"] for o in ran) == Counter(f"c-{i}" for i in range(40))
    capsysbinary.readouterr()
    assert main(["--redis-url", url, "--redis-cluster", "results", batch_id]) == 0
    assert len(capsysbinary.readouterr().out.splitlines()) == 50
    r.close()
