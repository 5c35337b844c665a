"""`python -m producer batch ...`: batch jobs without HTTP, as a user runs them (a
subprocess), a worker serving in this process, and the gateway seeing the same batch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.test_gateway import running_gateway
from tests.rigs.paths import REPO_ROOT


def batch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer", "batch", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


def write_input(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": f"text number {i}"}}) + "\n" for i in range(count)))
    return path


def test_run_is_a_drop_in_for_vllm_run_batch_files(redis_url: str, tmp_path: Path,
                                                   worker_factory: Callable[..., Any]) -> None:
    source, out = write_input(tmp_path / "in.jsonl", 30), tmp_path / "out.jsonl"
    with worker_factory(model="minilm"):
        done = batch("--redis-url", redis_url, "run", "-i", str(source), "-o", str(out))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(30))
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows)
    assert len(rows[0]["response"]["body"]["data"][0]["embedding"]) == 384


def test_a_batch_created_from_the_cli_is_the_gateways_too(
        redis_url: str, tmp_path: Path, worker_factory: Callable[..., Any]) -> None:
    source = write_input(tmp_path / "in.jsonl", 5)
    with worker_factory(model="minilm"), running_gateway(redis_url) as base_url:
        created = batch("--redis-url", redis_url, "create", str(source), "--wait")
        assert created.returncode == 0, created.stderr
        batch_id = json.loads(created.stdout)["id"]
        seen = httpx.get(f"{base_url}/v1/batches/{batch_id}").json()
        assert seen["status"] == "completed" and seen["request_counts"]["completed"] == 5
        status = batch("--redis-url", redis_url, "status", batch_id)
        assert json.loads(status.stdout)["output_file_id"] == seen["output_file_id"]
        results = batch("--redis-url", redis_url, "results", batch_id)
        assert len(results.stdout.splitlines()) == 5
        listed = batch("--redis-url", redis_url, "list")
        assert batch_id in listed.stdout
        other = batch("--redis-url", redis_url, "--api-key", "k", "status", batch_id)
        assert other.returncode != 0 and "no batch" in other.stderr


def test_a_batch_made_with_the_plain_redis_commands_of_the_protocol_runs(
        r: Any, redis_url: str, worker_factory: Callable[..., Any]) -> None:
    """docs/protocol.md's "Creating a batch from plain Redis", its script read from the doc:
    the gateway's runner finds the batch and answers its lines."""
    doc = (REPO_ROOT / "docs" / "protocol.md").read_text()
    section = doc[doc.index("### Creating a batch from plain Redis"):]
    start = section.index("```lua\n") + len("```lua\n")
    create = section[start:section.index("```", start)]
    file_id, batch_id, now_ms = "file-" + "ab" * 12, "batch_" + "cd" * 12, int(time.time() * 1000)
    rows = [json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/embeddings",
                        "body": {"model": "minilm", "input": f"plain {i}"}}) for i in range(3)]
    r.hset(f"redbatch:file:{{{file_id}}}:lines", mapping=dict(enumerate(rows)))
    r.hset(f"redbatch:file:{{{file_id}}}", mapping={
        "id": file_id, "bytes": sum(len(x) + 1 for x in rows), "created_at": now_ms // 1000,
        "created_ms": now_ms, "filename": "in.jsonl", "purpose": "batch", "owner": "public",
        "lines": 3})
    r.zadd("redbatch:files:{public}", {file_id: now_ms})
    r.zadd("redbatch:batches:active", {batch_id: now_ms}, nx=True)
    meta = {"id": batch_id, "owner": "public", "endpoint": "/v1/embeddings",
            "input_file_id": file_id, "completion_window": "24h", "status": "validating",
            "created_at": now_ms // 1000, "created_ms": now_ms,
            "expires_at": now_ms // 1000 + 86400, "total": 0, "completed": 0, "failed": 0,
            "metadata": ""}
    assert r.eval(create, 1, f"redbatch:batch:{{{batch_id}}}",
                  *[part for pair in meta.items() for part in pair]) == 1
    r.zadd("redbatch:batches:{public}", {batch_id: now_ms})
    with worker_factory(model="minilm"), running_gateway(redis_url) as base_url:
        deadline = time.monotonic() + 60
        while (seen := httpx.get(f"{base_url}/v1/batches/{batch_id}").json())["status"] \
                != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
    assert seen["status"] == "completed" and seen["request_counts"]["completed"] == 3
    output = r.lrange(f"redbatch:batch:{{{batch_id}}}:output", 0, -1)
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["p0", "p1", "p2"]
