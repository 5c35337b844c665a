"""Preprocessing of the next requests overlaps the model's compute of the current batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from producer import Client
from worker.models import Model, Prepared


class RecordingModel(Model):
    """Sleeps in prepare and forward (both release the GIL) and records when each ran."""

    default_bucket_boundaries = ()

    def __init__(self) -> None:
        self.prepares: list[float] = []
        self.forwards: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def load(self, device: torch.device) -> None:
        pass

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        time.sleep(0.01)
        with self.lock:
            self.prepares.append(time.monotonic())
        return Prepared(1, payload)

    def collate(self, items: Sequence[Prepared]) -> list[Any]:
        return [item.data for item in items]

    def forward(self, batch: list[Any]) -> list[Any]:
        start = time.monotonic()
        time.sleep(0.2)
        with self.lock:
            self.forwards.append((start, time.monotonic()))
        return batch

    def postprocess(self, output: list[Any], items: Sequence[Prepared]) -> list[Any]:
        return output


def test_prepare_runs_while_a_batch_computes(redis_url: str, worker_factory) -> None:
    client = Client(redis_url, "recordingmodel")
    with worker_factory(model="tests.redis.single.test_overlap:RecordingModel", max_batch_size=4,
                        max_wait_ms=0, read_count=4) as worker:
        model: Any = worker.model
        assert type(model).__name__ == "RecordingModel"
        reply_to = client.new_reply_key()
        client.submit_many([{"n": i} for i in range(24)], reply_to=reply_to)
        envelopes = client.collect(reply_to, 24, timeout=30)
    assert len(envelopes) == 24 and all(e["ok"] for e in envelopes)
    overlapping = [t for t in model.prepares
                   if any(start < t < end for start, end in model.forwards)]
    assert overlapping, "no request was prepared while a batch was computing"
