"""`echo`: returns each payload unchanged; with a cost model it stands in for a device.

The cost model (model options, all 0 by default, so echo costs nothing):

- `delay_ms` per batch, `per_item_ms` per request in the batch, `per_token_ms` per padded
  token (batch size x its longest length; echo's length is the payload's encoded byte size),
  so mixed lengths cost differently, like a transformer;
- `jitter_ms` of seeded Gaussian noise added to each batch's cost (never below zero);
- a drift: once `drift_after_requests` requests have been read (prepared; the warm-up's
  samples do not count), every later batch costs `drift_factor` times as much, a device that
  slows down mid-run, deterministically.

For the latency-target tests and benchmarks. The per-token cost needs the batch echo
collates (`EchoBatch`); a device copy that rebuilds it as a plain list drops that term.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.models.base import Model, Prepared


@dataclass(frozen=True, slots=True)
class EchoCost:
    """The modelled device time of a batch, in ms, before noise: pure, for tests to pin."""

    delay_ms: float = 0.0
    per_item_ms: float = 0.0
    per_token_ms: float = 0.0
    drift_factor: float = 1.0

    def mean_ms(self, size: int, longest: int, drifted: bool) -> float:
        cost = self.delay_ms + self.per_item_ms * size + self.per_token_ms * size * longest
        return cost * self.drift_factor if drifted else cost


class EchoBatch(list[Any]):
    """The payloads of one batch, with its longest length (for the per-token cost)."""

    def __init__(self, items: Iterable[Any] = (), longest: int = 0) -> None:
        super().__init__(items)
        self.longest = longest


class ReadCount:
    """Requests read (prepared) so far, and whether `drift_after_requests` of them were:
    the point from which a drifting model slows down (None: never). Thread-safe."""

    def __init__(self, drift_after_requests: int | None) -> None:
        if drift_after_requests is not None and (isinstance(drift_after_requests, bool)
                                                 or not isinstance(drift_after_requests, int)
                                                 or drift_after_requests < 0):
            raise ValueError("drift_after_requests must be an integer >= 0")
        self.after = drift_after_requests
        self.read = 0
        self._lock = threading.Lock()

    def count(self) -> None:
        if self.after is not None:
            with self._lock:
                self.read += 1

    @property
    def drifted(self) -> bool:
        return self.after is not None and self.read >= self.after


def check_options(delay_ms: float, per_item_ms: float, per_token_ms: float, jitter_ms: float,
                  drift_factor: float) -> None:
    """Refuse a cost model that makes no sense, naming the option."""
    for name, value in (("delay_ms", delay_ms), ("per_item_ms", per_item_ms),
                        ("per_token_ms", per_token_ms), ("jitter_ms", jitter_ms)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0")
    if drift_factor <= 0:
        raise ValueError("drift_factor must be > 0")


class EchoModel(Model):
    default_bucket_boundaries = (64, 256, 1024, 4096)
    concurrent_forward = True  # stateless but for the seeded noise and the read count

    def __init__(self, delay_ms: float = 0.0, per_item_ms: float = 0.0, jitter_ms: float = 0.0,
                 seed: int = 0, per_token_ms: float = 0.0,
                 drift_after_requests: int | None = None, drift_factor: float = 1.0) -> None:
        check_options(delay_ms, per_item_ms, per_token_ms, jitter_ms, drift_factor)
        self.reads = ReadCount(drift_after_requests)
        self.cost = EchoCost(delay_ms, per_item_ms, per_token_ms, drift_factor)
        self.jitter_s = jitter_ms / 1000.0
        self._noise = random.Random(seed)
        self._lock = threading.Lock()  # instances draw from one seeded sequence

    def cost_s(self, size: int, longest: int = 0) -> float:
        """The modelled device time of a batch of `size`, padded to `longest`."""
        cost = self.cost.mean_ms(size, longest, self.reads.drifted) / 1000.0
        if self.jitter_s:
            with self._lock:
                cost += self._noise.gauss(0.0, self.jitter_s)
        return max(0.0, cost)

    def load(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        self.reads.count()
        return Prepared(length=nbytes, data=payload)

    def sample(self, length: int) -> Prepared:
        return Prepared(length=length, data="x" * length)

    def collate(self, items: Sequence[Prepared]) -> list[Any]:
        return EchoBatch((item.data for item in items),
                         max((item.length for item in items), default=0))

    def forward(self, batch: list[Any]) -> list[Any]:
        cost = self.cost_s(len(batch), getattr(batch, "longest", 0))
        if cost:
            time.sleep(cost)  # releases the GIL, like a GPU kernel would
        return batch

    def postprocess(self, output: list[Any], items: Sequence[Prepared]) -> list[Any]:
        return list(output)
