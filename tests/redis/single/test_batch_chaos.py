"""Batch jobs through crashes: a gateway (whose runner holds the batch) and a worker killed
with -9 mid-batch, new ones started: every line gets exactly one output line.

Why slow (about 20 s): four process starts. Run once, on Redis 7 (heaviest_on_redis_7_only).
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import redis

from tests.rigs.chaos import (
    GatewayProcess,
    WorkerProcess,
    batch,
    heaviest_on_redis_7_only,
    wait_until,
)

LINES = 3000
WORKER_FLAGS = ("--model", "minilm", "--max-batch-size", "32", "--claim-idle-ms", "1000",
                "--block-ms", "200", "--maintenance-interval-s", "0.5")


def test_every_line_answered_once_through_gateway_and_worker_kills(
        r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    heaviest_on_redis_7_only(r)
    rows = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": "minilm", "input": f"line {i} of the batch"}})
                   + "\n" for i in range(LINES))
    workers = [WorkerProcess(redis_url, tmp_path / f"w{i}.log", *WORKER_FLAGS)
               for i in range(2)]
    gateway = GatewayProcess(redis_url, tmp_path / "gateway.log")
    try:
        for worker in workers:
            worker.wait_serving()
        file_id = httpx.post(f"{gateway.base}/v1/files", data={"purpose": "batch"},
                             files={"file": ("in.jsonl", rows.encode())}).json()["id"]
        batch_id = httpx.post(f"{gateway.base}/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/embeddings",
            "completion_window": "24h"}).json()["id"]
        wait_until(lambda: batch(gateway.base, batch_id)["request_counts"]["completed"] > 300,
                   60, "a tenth of the lines")
        gateway.kill()
        workers[0].signal(signal.SIGKILL)
        workers.append(WorkerProcess(redis_url, tmp_path / "w2.log", *WORKER_FLAGS))
        gateway = GatewayProcess(redis_url, tmp_path / "gateway.log")
        wait_until(lambda: batch(gateway.base, batch_id)["status"] == "completed", 120,
                   "the batch to complete")
        done = batch(gateway.base, batch_id)
        output = httpx.get(f"{gateway.base}/v1/files/{done['output_file_id']}/content",
                           timeout=30).text.splitlines()
    finally:
        gateway.kill()
        for worker in workers:
            worker.stop()
    counts = Counter(json.loads(line)["custom_id"] for line in output)
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert done["error_file_id"] is None
    assert len(counts) == LINES and max(counts.values()) == 1
    assert all(json.loads(line)["response"]["status_code"] == 200 for line in output[:50])
    time.sleep(0)
