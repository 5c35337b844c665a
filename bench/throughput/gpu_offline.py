"""gpu_compare's offline limits: redbatch's own model and executor in a loop, no Redis.

The model is loaded as the worker loads it at default settings (worker.model_loading.load_model: the
device's dtype), with the device's batch limits and buckets (policy/device_defaults.py) and,
on CUDA, the same CUDA graphs captured (execution/cuda_graphs.install). Two loops:
  forward only  pre-tokenised items sorted by length, cut under both batch limits, the next
                batch staged while one computes: the device's and the executor's ceiling
  end to end    as sentence-transformers' `encode` does inside its clock: texts sorted by
                characters, each chunk of max_batch_size tokenised with the model's batched
                `prepare_many`, then staged, run and post-processed (rows of float32) as above
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.execution import cuda_graphs
from worker.execution.executor import Executor, Launched, dtype_name
from worker.models.base import Model, Prepared
from worker.policy.device_defaults import default_boundaries, on_device


@dataclass(slots=True)
class Offline:
    model: Model
    executor: Executor
    limits: tuple[int, int]  # max_batch_size, max_batch_tokens as resolved on the device

    @property
    def dtype(self) -> str:
        return dtype_name(self.model.dtype)


def offline_setup(device: torch.device) -> Offline:
    """MiniLM loaded, limited and graphed as a default worker on `device` has it."""
    from worker.model_loading import load_model
    from worker.settings import load_settings

    settings = on_device(load_settings(None, model="minilm", device=str(device),
                                       metrics_port=0), device.type)
    model, device = load_model(settings)
    executor = Executor(model, device)
    limits = (settings.max_batch_size, settings.max_batch_tokens)
    if settings.cuda_graphs:  # a no-op without CUDA
        boundaries = default_boundaries(model.default_bucket_boundaries, device.type)
        cuda_graphs.install([executor], model, device, boundaries, *limits)
    return Offline(model, executor, limits)


def length_sorted_batches(items: Sequence[Prepared], max_rows: int,
                          max_tokens: int) -> list[list[Prepared]]:
    """Items sorted by length, cut into batches under both limits (as ST sorts its input)."""
    batches: list[list[Prepared]] = [[]]
    for item in sorted(items, key=lambda i: i.length):
        batch = batches[-1]
        if batch and (len(batch) >= max_rows or (len(batch) + 1) * item.length > max_tokens):
            batches.append(batch := [])
        batch.append(item)
    return [batch for batch in batches if batch]


def run_overlapped(executor: Executor, batches: Sequence[Sequence[Prepared]],
                   running: Launched | None = None) -> Launched | None:
    """Stage each batch while the one before computes; the last one is left running."""
    for batch in batches:
        staged = executor.stage(batch)
        if running is not None:
            executor.finish(running)
        running = executor.launch(staged)
    return running


def synchronized(device: torch.device) -> float:
    """perf_counter once the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def forward_only(offline: Offline, texts: Sequence[str], repeats: int = 2) -> float:
    """Texts/s, the best of `repeats` passes, tokenising outside the clock."""
    model, executor = offline.model, offline.executor
    items = [p for p in model.prepare_many([({"text": t}, len(t)) for t in texts])
             if isinstance(p, Prepared)]
    batches = length_sorted_batches(items, *offline.limits)
    best = 0.0
    for _ in range(repeats):
        started = synchronized(executor.device)
        last = run_overlapped(executor, batches)
        if last is not None:
            executor.finish(last)
        best = max(best, len(items) / (synchronized(executor.device) - started))
    return best


def end_to_end(offline: Offline, texts: Sequence[str], repeats: int = 2) -> float:
    """Texts/s, the best of `repeats` passes, tokenising (in chunks) inside the clock."""
    model, executor = offline.model, offline.executor
    rows = offline.limits[0]
    best = 0.0
    for _ in range(repeats):
        started = synchronized(executor.device)
        ordered = sorted(texts, key=len)  # in the clock: ST sorts inside encode too
        running: Launched | None = None
        for at in range(0, len(ordered), rows):
            chunk = ordered[at:at + rows]
            items = [p for p in model.prepare_many([({"text": t}, len(t)) for t in chunk])
                     if isinstance(p, Prepared)]
            running = run_overlapped(executor, length_sorted_batches(items, *offline.limits),
                                     running)
        if running is not None:
            executor.finish(running)
        best = max(best, len(texts) / (synchronized(executor.device) - started))
    return best
