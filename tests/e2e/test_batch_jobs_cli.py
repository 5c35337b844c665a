"""`python -m producer batch ...`: batch jobs without HTTP, as a user runs them (a
subprocess), a worker serving in this process, and the gateway seeing the same batch."""

from __future__ import annotations

import json
import subprocess
import sys
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
