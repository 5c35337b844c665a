"""A real model that slows down on cue, for the latency benchmark's G4 (drift) on MiniLM.

`DriftingMiniLM` is the MiniLM encoder (worker/models/minilm.py, unchanged) with echo's two
drift options: once `drift_after_requests` requests have been read (prepared), every later
batch takes `drift_factor` times as long as its forward did. The encoder really runs; the
extra time is slept after it (a device that has become that much slower, like a throttled
or shared one), so the factor is exact whatever the batch. A plugin model, named in the
worker's settings as `bench.latency.live.drifting:DriftingMiniLM`: nothing of it is in the worker.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from worker.models.base import Prepared
from worker.models.echo import ReadCount
from worker.models.minilm import MiniLMModel


def drift_sleep_s(forward_s: float, drifted: bool, factor: float) -> float:
    """How long to sleep after a forward of `forward_s`, so that it took `factor` x as long."""
    return max(0.0, (factor - 1.0) * forward_s) if drifted else 0.0


class DriftingMiniLM(MiniLMModel):
    def __init__(self, drift_after_requests: int | None = None, drift_factor: float = 1.0,
                 **options: Any) -> None:
        self.reads = ReadCount(drift_after_requests)
        if drift_factor < 1.0:
            raise ValueError("drift_factor must be >= 1 (a device that slows down)")
        super().__init__(**options)
        self.drift_factor = drift_factor

    @property
    def drifted(self) -> bool:
        return self.reads.drifted

    @property
    def read(self) -> int:
        return self.reads.read

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        prepared = super().prepare(payload, nbytes)
        self.reads.count()
        return prepared

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        started = time.perf_counter()
        output = super().forward(batch)
        time.sleep(drift_sleep_s(time.perf_counter() - started, self.drifted,
                                 self.drift_factor))
        return output
