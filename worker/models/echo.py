"""`echo`: returns each payload unchanged; with a cost model it stands in for a device.

`delay_ms` per batch, `per_item_ms` per request in the batch, and `jitter_ms` of seeded
Gaussian noise (never below zero): a device with a fixed and a per-item cost, for the
latency-target tests and benchmarks.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from worker.models.base import Model, Prepared


class EchoModel(Model):
    default_bucket_boundaries = (64, 256, 1024, 4096)
    concurrent_forward = True  # stateless: safe on several threads

    def __init__(self, delay_ms: float = 0.0, per_item_ms: float = 0.0, jitter_ms: float = 0.0,
                 seed: int = 0) -> None:
        for name, value in (("delay_ms", delay_ms), ("per_item_ms", per_item_ms),
                            ("jitter_ms", jitter_ms)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0")
        self.delay_s = delay_ms / 1000.0
        self.per_item_s = per_item_ms / 1000.0
        self.jitter_s = jitter_ms / 1000.0
        self._noise = random.Random(seed)
        self._noise_lock = threading.Lock()  # instances draw from one seeded sequence

    def cost_s(self, size: int) -> float:
        """The modelled device time of a batch of `size`."""
        cost = self.delay_s + self.per_item_s * size
        if self.jitter_s:
            with self._noise_lock:
                cost += self._noise.gauss(0.0, self.jitter_s)
        return max(0.0, cost)

    def load(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        return Prepared(length=nbytes, data=payload)

    def sample(self, length: int) -> Prepared:
        return Prepared(length=length, data="x" * length)

    def collate(self, items: Sequence[Prepared]) -> list[Any]:
        return [item.data for item in items]

    def forward(self, batch: list[Any]) -> list[Any]:
        cost = self.cost_s(len(batch))
        if cost:
            time.sleep(cost)  # releases the GIL, like a GPU kernel would
        return batch

    def postprocess(self, output: list[Any], items: Sequence[Prepared]) -> list[Any]:
        return output
