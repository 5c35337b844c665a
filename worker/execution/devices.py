"""Streams, events and pinned host buffers: one interface, real on CUDA, no-ops on CPU.

On CUDA a worker owns a copy stream (host-to-device copies) and a compute stream (the
model), ordered by events, so the copy of the next batch overlaps the current batch's
compute and the host waits only on the event it needs. On CPU every context is empty and
every event is already complete, so the same code runs, synchronously, in the tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch


class Marker:
    """A point in a stream's work (a CUDA event), also stamped with the host time.

    Other streams can wait for it on the device; the host can wait for it; two markers give
    the device time between them (the host time between them on CPU).
    """

    __slots__ = ("event", "timed", "host_time")

    def __init__(self, event: torch.cuda.Event | None, timed: bool = False) -> None:
        self.event = event
        self.timed = timed  # the event was created with enable_timing
        self.host_time = time.perf_counter()

    def make_wait(self, stream: torch.cuda.Stream | None) -> None:
        """Order `stream`'s later work after this point, without blocking the host."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the work before this point has finished."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def ms_until(self, later: Marker) -> float:
        """Time from this point to `later` (device time when both are timing events)."""
        if self.timed and later.timed:
            assert self.event is not None and later.event is not None
            return float(self.event.elapsed_time(later.event))
        return (later.host_time - self.host_time) * 1000


class Lanes:
    """The copy and compute streams of one device (none on CPU)."""

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.device = device
        self.timing = timing
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.compute_stream = torch.cuda.Stream(device) if self.is_cuda else None
        if self.is_cuda:
            torch.cuda.synchronize(device)  # weights loaded on the default stream are in place

    @contextmanager
    def copying(self) -> Iterator[None]:
        with self._on(self.copy_stream):
            yield

    @contextmanager
    def computing(self) -> Iterator[None]:
        with self._on(self.compute_stream):
            yield

    def mark(self) -> Marker:
        """Record an event on the current stream (a host timestamp only, on CPU)."""
        if not self.is_cuda:
            return Marker(None)
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record()
        return Marker(event, self.timing)

    def hand_to_compute(self, tensor: torch.Tensor) -> None:
        """A tensor made on the copy stream is used on the compute stream: tell the caching
        allocator, so its memory is not reused before the compute stream is done with it."""
        if self.compute_stream is not None and tensor.is_cuda:
            tensor.record_stream(self.compute_stream)

    def _on(self, stream: torch.cuda.Stream | None) -> Any:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()


@dataclass(slots=True, eq=False)  # compared by identity: `in` must not compare buffers
class Slot:
    buffer: torch.Tensor | None = None
    released: Marker | None = None  # the copy that last read this buffer


class PinnedStaging:
    """Host buffers reused per key (bucket and tensor), for asynchronous host-to-device copies.

    Each key has two slots (double buffering): a slot is refilled only after the copy that
    last read it has finished, so an in-flight copy never sees new data; a free slot is
    taken before a second buffer is made. Buffers grow to the largest shape seen, so after
    warm-up nothing is allocated per batch.
    """

    def __init__(self, pin: bool, slots: int = 2) -> None:
        self.pin = pin
        self.slots = slots
        self._slots: dict[Hashable, list[Slot]] = {}
        self._turn: dict[Hashable, int] = {}
        self._unreleased: list[Slot] = []
        self.allocations = 0

    def hold(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """A staging view holding `tensor`'s data, to copy from until release()."""
        slot = self._free_slot(key, tensor)
        numel = tensor.numel()
        if slot.buffer is None or slot.buffer.dtype != tensor.dtype or slot.buffer.numel() < numel:
            slot.buffer = torch.empty(numel, dtype=tensor.dtype, pin_memory=self.pin)
            self.allocations += 1
        view = slot.buffer[:numel].view(tensor.shape)
        view.copy_(tensor)
        self._unreleased.append(slot)
        return view

    def _free_slot(self, key: Hashable, tensor: torch.Tensor) -> Slot:
        """A slot whose last copy has finished, one with a buffer that fits first; when every
        slot's copy is still in flight, the next in turn, once its copy is done. (Taking
        slots strictly in turn allocated the second buffer even when the first was free.)"""
        slots = self._slots.setdefault(key, [Slot() for _ in range(self.slots)])
        free = [slot for slot in slots if slot not in self._unreleased
                and (slot.released is None or slot.released.done())]
        fitting = [slot for slot in free if slot.buffer is not None
                   and slot.buffer.dtype == tensor.dtype
                   and slot.buffer.numel() >= tensor.numel()]
        if fitting or free:
            return (fitting or free)[0]
        turn = self._turn.get(key, 0)
        self._turn[key] = (turn + 1) % self.slots
        slot = slots[turn]
        if slot.released is not None:
            slot.released.synchronize()
        return slot

    def release(self, copied: Marker) -> None:
        """The copies reading the slots held since the last release end at `copied`."""
        for slot in self._unreleased:
            slot.released = copied
        self._unreleased.clear()


def map_tensors(batch: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `move` to every tensor in a (nested) batch; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return move(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(value, move) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(map_tensors(value, move) for value in batch)
    return batch
