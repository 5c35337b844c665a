"""Plugin models for the tests, loaded as `tests.plugin_models:ClassName` like a user's own."""

from __future__ import annotations

import os
from typing import Any

import torch

from worker.models.echo import EchoModel


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# Results that neither JSON nor msgpack can encode, each failing in its own way.
UNENCODABLE = {"set": {1, 2}, "big int": 2**70, "deep": nested(5000)}


class FaultyModel(EchoModel):
    """Echo that fails a whole batch when a payload mentions "boom", and returns the
    unencodable results above for their names."""

    def forward(self, batch: list[Any]) -> list[Any]:
        if any("boom" in repr(item) for item in batch):
            raise RuntimeError("the model exploded")
        return [UNENCODABLE.get(item, item) if isinstance(item, str) else item
                for item in batch]


class UnloadableModel(EchoModel):
    """A model whose weights are missing."""

    def load(self, device: torch.device) -> None:
        raise FileNotFoundError("weights.bin not found")


POISON = {"poison": True}


class PoisonEcho(EchoModel):
    """Echo that kills its whole process, as a segfaulting kernel would, on one input."""

    def forward(self, batch: list[Any]) -> list[Any]:
        if POISON in batch:
            os._exit(70)
        return super().forward(batch)


class CountingEcho(EchoModel):
    """Echo that remembers every input it computed."""

    computed: list[Any] = []

    def forward(self, batch: list[Any]) -> list[Any]:
        type(self).computed.extend(batch)
        return super().forward(batch)
