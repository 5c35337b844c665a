"""Plugin models for the tests, loaded as `tests.rigs.plugin_models:ClassName` like a user's own,
and an injected memory reading for the governor."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from worker.models.base import Prepared
from worker.models.echo import EchoModel
from worker.models.generative import CausalLM
from worker.policy.governor import MemoryReading


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


class FixedMemory:
    """A memory probe that reads what the test says (the real probes have their own tests)."""

    def __init__(self, reading: MemoryReading) -> None:
        self.reading = reading
        self.released = 0

    def before_batch(self) -> None:
        pass

    def read(self) -> MemoryReading:
        return self.reading

    def release_cache(self) -> None:
        self.released += 1


class PressureModel(EchoModel):
    """Echo that runs out of memory, as a GPU would, on a batch over `max_padded_tokens`.

    Set `max_padded_tokens` to None to take the pressure away.
    """

    def __init__(self, max_padded_tokens: int | None = None) -> None:
        super().__init__()
        self.max_padded_tokens = max_padded_tokens
        self.batch_tokens: list[int] = []  # padded tokens of every batch that ran

    def collate(self, items: Sequence[Prepared]) -> tuple[int, list[Any]]:
        return len(items) * max(item.length for item in items), [item.data for item in items]

    def forward(self, batch: tuple[int, list[Any]]) -> list[Any]:
        tokens, payloads = batch
        if self.max_padded_tokens is not None and tokens > self.max_padded_tokens:
            raise torch.OutOfMemoryError(f"{tokens} padded tokens > {self.max_padded_tokens}")
        self.batch_tokens.append(tokens)
        return payloads


class RecordingModel(EchoModel):
    """Echo that records the order of its steps, to see the double buffering."""

    def __init__(self, delay_ms: float = 0.0) -> None:
        super().__init__(delay_ms)
        self.steps: list[tuple[str, int]] = []  # (step, first payload of the batch)
        self._lock = threading.Lock()

    def _record(self, step: str, items: Sequence[Prepared]) -> None:
        with self._lock:
            self.steps.append((step, items[0].data["i"]))

    def collate(self, items: Sequence[Prepared]) -> list[Any]:
        self._record("collate", items)
        return super().collate(items)

    def postprocess(self, output: list[Any], items: Sequence[Prepared]) -> list[Any]:
        self._record("postprocess", items)
        return output


class MatmulModel(EchoModel):
    """Pure tensor work with a sizeable input copy: shows stream overlap without HF code."""

    def __init__(self, dim: int = 2048, rounds: int = 30) -> None:
        super().__init__()
        self.dim, self.rounds = dim, rounds

    def load(self, device: torch.device) -> None:
        super().load(device)
        self.weight = torch.randn(self.dim, self.dim, device=device) / self.dim**0.5

    def collate(self, items: Sequence[Prepared]) -> torch.Tensor:
        return torch.ones(len(items) * 64, self.dim)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        for _ in range(self.rounds):
            batch = torch.tanh(batch @ self.weight)
        return batch.sum(dim=1)

    def postprocess(self, output: torch.Tensor, items: Sequence[Prepared]) -> list[Any]:
        return [float(value) for value in output[:: 64].tolist()]


class CostModel(EchoModel):
    """Takes `fixed_ms` per batch plus `per_token_ms` per padded token, like a real model,
    and `cold_ms` more on each padded shape's first forward (kernel selection, allocation).
    Each forward's modelled seconds go to `modelled_s` (shared), for a clock-free test."""

    modelled_s: ClassVar[list[float]] = []

    def __init__(self, fixed_ms: float = 20.0, per_token_ms: float = 0.5,
                 cold_ms: float = 0.0) -> None:
        super().__init__()
        self.fixed_s, self.per_token_s = fixed_ms / 1000, per_token_ms / 1000
        self.cold_s = cold_ms / 1000
        self.shapes_seen = set[int]()

    def collate(self, items: Sequence[Prepared]) -> tuple[int, list[Any]]:
        return len(items) * max(item.length for item in items), [item.data for item in items]

    def forward(self, batch: tuple[int, list[Any]]) -> list[Any]:
        padded_tokens, data = batch
        cold = self.cold_s if padded_tokens not in self.shapes_seen else 0.0
        self.shapes_seen.add(padded_tokens)
        self.modelled_s.append(self.fixed_s + self.per_token_s * padded_tokens + cold)
        time.sleep(self.modelled_s[-1])
        return data


class SerialEcho(EchoModel):
    """An echo that does not declare concurrent_forward: `instances = "auto"` runs one."""

    concurrent_forward = False


class SlowStepLM(CausalLM):
    """The causal LM with every forward of the model followed by a sleep of `step_ms` (a
    step runs one or more): a generation of n tokens takes at least n x step_ms, so it
    outlasts a grace or a claim time by construction, on a fast host as on a slow one (a
    sleep never returns early)."""

    def __init__(self, step_ms: float = 20.0, **options: Any) -> None:
        super().__init__(**options)
        self.step_s = step_ms / 1000

    def load(self, device: Any) -> None:
        super().load(device)
        forward = self.lm.forward

        def slow_forward(*args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            time.sleep(self.step_s)
            return output

        self.lm.forward = slow_forward


class ShortOfMemoryLM(CausalLM):
    """The causal LM on a device that runs out of memory in any forward of more than
    `max_tokens` tokens or `max_rows` rows (what a step's activations would need), as CUDA
    does: an OutOfMemoryError raised from inside the model's forward. `out_of_memory` counts
    them."""

    def __init__(self, max_tokens: int = 24, max_rows: int = 2, **options: Any) -> None:
        super().__init__(**options)
        self.max_tokens, self.max_rows = max_tokens, max_rows
        self.out_of_memory = 0

    def load(self, device: Any) -> None:
        super().load(device)
        forward = self.lm.forward

        def short_forward(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs["input_ids"]
            if ids.numel() > self.max_tokens or ids.shape[0] > self.max_rows:
                self.out_of_memory += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return forward(*args, **kwargs)

        self.lm.forward = short_forward
