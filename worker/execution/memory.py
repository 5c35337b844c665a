"""Reading device memory for the governor (the I/O edge of worker/policy/governor.py).

CUDA: `mem_get_info` for what others hold, plus this process's peak in live tensors during
the batch (the caching allocator's reserve is reusable, so it does not count as pressure).
CPU: the process RSS against `memory_limit_bytes`, else the cgroup limit, else physical RAM.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Protocol

import psutil
import torch

from worker.policy.governor import MemoryReading

CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
                      Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))  # cgroup v1
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number
# A failed batch's garbage is young: collecting the young generations frees any of it caught
# in reference cycles in about a millisecond; a full collection can take a fifth of a second.
YOUNG = 1


class MemoryProbe(Protocol):
    def before_batch(self) -> None:
        """Start measuring this batch's peak."""

    def read(self) -> MemoryReading:
        """Memory now, with the peak since before_batch()."""

    def release_cache(self) -> None:
        """Give cached, unused memory back (after an OOM, or when fragmented)."""


def _open_statm() -> int | None:
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:  # not Linux
        return None


def cgroup_memory_limit(files: tuple[Path, ...] = CGROUP_LIMIT_FILES) -> int | None:
    """This container's memory limit, or None when there is none (psutil does not read it)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < UNLIMITED:
            return int(text)
        return None
    return None


class HostMemory:
    """The process RSS against a limit."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit = limit_bytes or cgroup_memory_limit() or psutil.virtual_memory().total
        self._process = psutil.Process()
        self._statm = _open_statm()
        if self._statm is not None:
            weakref.finalize(self, os.close, self._statm)

    def before_batch(self) -> None:
        pass

    def read(self) -> MemoryReading:
        return MemoryReading(used=self.rss(), limit=self.limit)

    def rss(self) -> int:
        """Read after every batch: on Linux one pread of /proc/self/statm on a file kept
        open (a few microseconds; psutil opens the file each time, ten times slower)."""
        if self._statm is None:
            return int(self._process.memory_info().rss)
        return int(os.pread(self._statm, 256, 0).split()[1]) * PAGE_SIZE

    def release_cache(self) -> None:
        gc.collect(YOUNG)


class CudaMemory:
    """One CUDA device: what others hold plus our peak, against the device (or a lower limit)."""

    def __init__(self, device: torch.device, limit_bytes: int | None = None) -> None:
        self.device = device
        total = torch.cuda.mem_get_info(device)[1]
        self.limit = min(total, limit_bytes) if limit_bytes else total

    def before_batch(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading:
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        peak = max(allocated, torch.cuda.max_memory_allocated(self.device))
        others = max(0, total - free - reserved)  # other processes, the CUDA context, ...
        return MemoryReading(used=others + peak, limit=self.limit, reserved=reserved,
                             allocated=allocated)

    def release_cache(self) -> None:
        gc.collect(YOUNG)
        torch.cuda.empty_cache()


def memory_probe(device: torch.device, limit_bytes: int | None = None) -> MemoryProbe:
    if device.type == "cuda":
        return CudaMemory(device, limit_bytes)
    return HostMemory(limit_bytes)
