"""Model execution: choosing the device and running one batch on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from worker.models.base import Model, Prepared


def resolve_device(name: str) -> torch.device:
    """`auto` means the first CUDA device when one is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


class Executor:
    """Runs a model's batches on one device."""

    def __init__(self, model: Model, device: torch.device) -> None:
        self.model = model
        self.device = device

    def run(self, items: Sequence[Prepared]) -> list[Any]:
        """Collate, copy to the device, forward and postprocess one batch."""
        batch = to_device(self.model.collate(items), self.device)
        with torch.inference_mode():
            output = self.model.forward(batch)
            results = self.model.postprocess(output, items)
        if len(results) != len(items):
            raise RuntimeError(f"model returned {len(results)} results for {len(items)} inputs")
        return results
