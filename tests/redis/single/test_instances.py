"""`instances`: several model instances in one process take batches from one queue."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from producer import Client
from producer.protocol import MSGPACK
from producer.request_entry import Request
from tests.rigs.workers import loaded_model
from worker.app import assemble_worker, connect
from worker.execution.executor import Executor, resolve_device
from worker.models.echo import EchoModel
from worker.policy.batching import Pending
from worker.settings import load_settings


class OverlapCountingEcho(EchoModel):
    """Echo (with its `delay_ms`) that records the most forwards that ever ran at once."""

    def __init__(self, delay_ms: float = 0.0) -> None:
        super().__init__(delay_ms)
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.batches = 0

    def forward(self, batch: list[Any]) -> list[Any]:
        with self.lock:
            self.running += 1
            self.batches += 1
            self.most = max(self.most, self.running)
        try:
            return super().forward(batch)
        finally:
            with self.lock:
                self.running -= 1


MODEL = "tests.redis.single.test_instances:OverlapCountingEcho"


@pytest.mark.parametrize("instances", [1, 2, 3])
def test_instances_compute_batches_at_once(redis_url: str, worker_factory: Callable[..., Any],
                                           instances: int) -> None:
    client = Client(redis_url, "overlapcountingecho")
    model = OverlapCountingEcho(delay_ms=150)
    with worker_factory(model=MODEL, instance=model, instances=instances, max_batch_size=1,
                        max_wait_ms=0):
        reply_to = client.new_reply_key()
        client.submit_many([{"n": i} for i in range(6)], reply_to=reply_to)
        envelopes = client.collect(reply_to, 6, timeout=30)
    assert sorted(e["result"]["n"] for e in envelopes) == list(range(6))
    assert model.batches == 6
    # A busy instance does not stage the next batch while another is idle: it goes to the
    # idle one at once, so all of them compute together.
    assert model.most == instances


def test_a_failing_instance_stops_the_worker_with_a_failure(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "echo")
    with worker_factory(instances=2) as worker:
        def broken(*args: Any) -> None:
            raise RuntimeError("a bug in the compute loop")

        worker.runners[1].stage = broken  # type: ignore[method-assign]
        worker.runners[0].stage = broken  # type: ignore[method-assign]
        client.submit_many([{"n": i} for i in range(4)], reply_to=client.new_reply_key())
        assert worker.stopping.wait(10)
    assert worker.failed


def test_a_busy_instance_leaves_the_next_batch_to_an_idle_one(redis_url: str) -> None:
    """Staging ahead (the CUDA double buffer) would hold the batch until the current one is
    done; an idle instance can start it now."""
    settings = load_settings(None, redis_url=redis_url, model="echo", instances=2,
                             max_wait_ms=0, metrics_port=0)
    model = loaded_model("echo", {})
    worker = assemble_worker(settings, model, Executor(model, resolve_device("cpu")),
                    connect(redis_url, settings.block_ms))
    request = Request("r1", b"", MSGPACK, "reply")
    worker.batcher.add(Pending("1-0", request, model.prepare({"n": 1}, 8), read_at=0.0))
    worker.inflight.idle = 1  # the other instance waits for work
    assert worker.computes[0].next_batch(block=False) is None
    worker.inflight.idle = 0
    batch = worker.computes[0].next_batch(block=False)
    assert batch is not None and [p.entry_id for p in batch.members] == ["1-0"]
