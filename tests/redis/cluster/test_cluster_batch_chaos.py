"""Batch jobs through crashes on a real Redis Cluster (tests/rigs/cluster.py, 3 masters + 3
replicas): a gateway process (`--redis-cluster true`, its runner holding the batch under a
1 s lease) is killed with -9 mid-batch and a new one takes the batch over; then the worker
process is killed with -9 mid-batch and a new one reclaims its entries (claim idle 1 s).
Every custom_id is answered exactly once across the output and error files, the counts add
up, and every key of the batch is in one slot. tests/redis/single/test_batch_chaos.py is the
same scenario on one Redis.

The model is the tiny BERT encoder built offline (tests/rigs/tiny_encoders.py). About 22 s
on 2 cores: the cluster's start and the model's build (~8.5 s; the `cluster` fixture is per
module, as in the other cluster modules), four process starts (two gateways, two workers,
the workers' torch import most of it) and the 1800 lines (~12 s together).
`--batch-takeover-s 3` (tests/rigs/chaos.py) bounds the stall when the killed gateway had
recorded lines it never queued: a takeover admits them again after `batch_takeover_s`, 30 s
by default (1 run in 3: 54 such lines, the test 25 s longer).
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from producer.batches import keys
from producer.shards import key_slot
from tests.rigs.chaos import GatewayProcess, WorkerProcess, batch, report, wait_until
from tests.rigs.cluster import ClusterRig, cluster, rig
from tests.rigs.tiny_encoders import build_tiny_encoder

__all__ = ["cluster", "rig"]  # the fixtures, imported for pytest
MODEL = "encoder"
LINES = 1800
STEP = 200  # lines completed between one kill and the next
GATEWAY_FLAGS = ("--redis-cluster", "true")


@pytest.fixture(scope="module")
def worker_flags(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """A worker process's flags: the tiny encoder, untraced (tracing costs seconds), and a
    short claim idle so a new worker reclaims a killed one's entries within a second."""
    path = build_tiny_encoder(tmp_path_factory.mktemp("tiny") / "encoder")
    return ("--redis-cluster", "true", "--model", MODEL, "--model-options",
            json.dumps({"path": str(path), "trace": False}), "--warmup", "false",
            "--max-batch-size", "32", "--claim-idle-ms", "1000", "--block-ms", "200",
            "--maintenance-interval-s", "0.5")


def upload(base: str) -> str:
    """The input file's id: LINES embedding lines."""
    rows = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": MODEL, "input": f"line {i} of the batch"}})
                   + "\n" for i in range(LINES))
    found: str = httpx.post(f"{base}/v1/files", data={"purpose": "batch"},
                            files={"file": ("in.jsonl", rows.encode())}).json()["id"]
    return found


def create(base: str, file_id: str) -> str:
    found: str = httpx.post(f"{base}/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/embeddings",
        "completion_window": "24h"}).json()["id"]
    return found


def completed(base: str, batch_id: str) -> int:
    count: int = batch(base, batch_id)["request_counts"]["completed"]
    return count


def content(base: str, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = httpx.get(f"{base}/v1/files/{file_id}/content", timeout=30).text
    return [json.loads(line) for line in text.splitlines()]


def batch_slots(rig: ClusterRig, batch_id: str) -> set[int]:
    """The slots of every key in the cluster tagged with the batch's id."""
    found: set[int] = set()
    for node in rig.masters():
        with node.client() as client:
            found |= {key_slot(k.decode())
                      for k in client.scan_iter(match=f"*{{{batch_id}}}*", count=1000)}
    return found


class Processes:
    """Starts the test's gateway and worker processes, each killed when the block ends."""

    def __init__(self, url: str, logs: Path, worker_flags: tuple[str, ...],
                 stack: ExitStack) -> None:
        self.url, self.logs, self.worker_flags, self.stack = url, logs, worker_flags, stack

    def worker(self, name: str) -> WorkerProcess:
        worker = WorkerProcess(self.url, self.logs / f"{name}.log", *self.worker_flags)
        self.stack.callback(worker.stop)
        return worker

    def gateway(self, name: str) -> GatewayProcess:
        """A new gateway, ready."""
        gateway = GatewayProcess(self.url, self.logs / f"{name}.log", *GATEWAY_FLAGS)
        self.stack.callback(gateway.kill)
        return gateway


def test_every_line_answered_once_through_gateway_and_worker_kills_on_a_cluster(
        rig: ClusterRig, worker_flags: tuple[str, ...], tmp_path: Path) -> None:
    with ExitStack() as stack:
        start = Processes(rig.url(), tmp_path, worker_flags, stack)
        first_worker = start.worker("w0")
        first_gateway = start.gateway("g0")
        first_worker.wait_serving()  # the runner checks the batch's model against it
        batch_id = create(first_gateway.base, upload(first_gateway.base))
        wait_until(lambda: completed(first_gateway.base, batch_id) >= STEP, 60,
                   "the first lines")
        at_gateway_kill = completed(first_gateway.base, batch_id)
        first_gateway.kill()
        base = start.gateway("g1").base
        # STEP exceeds the window: the new gateway has admitted lines, not only settled
        # the ones the killed one left in flight
        wait_until(lambda: completed(base, batch_id) >= at_gateway_kill + STEP, 60,
                   "lines completed under the new gateway")
        first_worker.signal(signal.SIGKILL)
        at_worker_kill = completed(base, batch_id)
        second_worker = start.worker("w1").wait_serving()
        wait_until(lambda: batch(base, batch_id)["status"] == "completed", 90,
                   "the batch to complete")
        # the killed worker held entries: the new one reclaimed them (claim idle 1 s)
        wait_until(lambda: second_worker.logged("entries.claimed"), 10, "a reclaim")
        done = batch(base, batch_id)
        output = content(base, done["output_file_id"])
        errors = content(base, done["error_file_id"])
    report("cluster batch kills", at_gateway_kill=at_gateway_kill,
           at_worker_kill=at_worker_kill, failed=len(errors))
    assert at_worker_kill < LINES, "the worker was killed after the batch's last line"
    counts = Counter(line["custom_id"] for line in output + errors)
    assert counts == Counter(f"c{i}" for i in range(LINES))  # every line exactly once
    assert done["request_counts"] == {"total": LINES, "completed": len(output),
                                      "failed": len(errors)}
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert batch_slots(rig, batch_id) == {key_slot(keys.BatchKeys("redbatch", batch_id).meta)}
