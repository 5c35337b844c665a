"""Plugin models for the tests, loaded as `tests.plugin_models:ClassName` like a user's own."""

from __future__ import annotations

from typing import Any

import torch

from worker.models.echo import EchoModel


class FaultyModel(EchoModel):
    """Echo that fails a whole batch when a payload mentions "boom", and returns an
    unencodable result for the payload "set"."""

    def forward(self, batch: list[Any]) -> list[Any]:
        if any("boom" in repr(item) for item in batch):
            raise RuntimeError("the model exploded")
        return [{1, 2} if item == "set" else item for item in batch]


class UnloadableModel(EchoModel):
    """A model whose weights are missing."""

    def load(self, device: torch.device) -> None:
        raise FileNotFoundError("weights.bin not found")
