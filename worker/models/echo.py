"""`echo`: returns each payload unchanged; with `delay_ms` it stands in for device time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from worker.models.base import Model, Prepared


class EchoModel(Model):
    default_bucket_boundaries = (64, 256, 1024, 4096)
    concurrent_forward = True  # stateless: safe on several threads

    def __init__(self, delay_ms: float = 0.0) -> None:
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.delay_s = delay_ms / 1000.0

    def load(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        return Prepared(length=nbytes, data=payload)

    def sample(self, length: int) -> Prepared:
        return Prepared(length=length, data="x" * length)

    def collate(self, items: Sequence[Prepared]) -> list[Any]:
        return [item.data for item in items]

    def forward(self, batch: list[Any]) -> list[Any]:
        if self.delay_s:
            time.sleep(self.delay_s)  # releases the GIL, like a GPU kernel would
        return batch

    def postprocess(self, output: list[Any], items: Sequence[Prepared]) -> list[Any]:
        return output
