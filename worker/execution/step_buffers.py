"""One step's inputs, copied to the device in one go through preallocated buffers.

Why: a decoding step needs several small integer tensors on the device (token ids, positions,
the KV slots each token writes and each row reads, the sampler's per-row inputs). Made one
by one, each is an allocation and a blocking host-to-device copy, and a GPU waits on every
one. Here the host writes them, in place, into one preallocated int64 buffer (pinned on
CUDA, so the copy is asynchronous), one copy moves it to a preallocated device buffer, and
the step's tensors are views of that. Floats ride as their float64 bits. A buffer grows (to
the next power of two) only when a step needs more than any before.

The step's tokens come back the same way: one copy into a preallocated pinned buffer,
asynchronous, with an event the host waits on only when it reads them. Two such buffers
take turns, since the host may still read step n's while step n + 1's copy is queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INITIAL_CAPACITY = 4096


class StepBuffers:
    def __init__(self, device: torch.device, capacity: int = INITIAL_CAPACITY) -> None:
        self.device = device
        self.copies = 0  # host-to-device copies made (what a step costs; tests count it)
        self.copies_back = 0  # device-to-host copies of tokens
        self._pinned = device.type == "cuda"
        self._copied: torch.cuda.Event | None = None
        self._back = [torch.empty(0, dtype=torch.long, pin_memory=self._pinned)
                      for _ in range(2)]
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.long, pin_memory=self._pinned)
        # the same memory as numpy: it writes a list of ints ~6x faster than torch.tensor
        # makes one (a step's staging is a large share of its host time)
        self._host_array = self.host.numpy()
        self.staged = self.host if self.device.type == "cpu" else \
            torch.empty(capacity, dtype=torch.long, device=self.device)

    def upload(self, parts: Sequence[Sequence[int] | torch.Tensor]) -> list[torch.Tensor]:
        """Write the parts one after another into the host buffer, copy it to the device
        once; returns each part's view on the device (valid until the next upload)."""
        sizes = [len(part) for part in parts]
        total = sum(sizes)
        if self._copied is not None:  # the previous copy must have read the host buffer
            self._copied.synchronize()
        if total > self.host.numel():
            self._allocate(1 << (total - 1).bit_length())
        at = 0
        for part, size in zip(parts, sizes, strict=True):
            if isinstance(part, torch.Tensor):
                self.host[at:at + size] = part
            else:
                self._host_array[at:at + size] = part
            at += size
        if self.staged is not self.host:
            self.staged[:total].copy_(self.host[:total], non_blocking=self._pinned)
            if self._pinned:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self.copies += 1
        views, at = [], 0
        for size in sizes:
            views.append(self.staged[at:at + size])
            at += size
        return views

    def download(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The tokens on the host: on a CPU the tensor itself; on a device a view of the
        next pinned buffer, copied asynchronously, and the event that marks the copy done."""
        self.copies_back += 1
        if tokens.device.type == "cpu":
            return tokens, None
        self._back.reverse()  # the other buffer: the last one's tokens may be unread yet
        size = tokens.numel()
        if size > self._back[0].numel():
            self._back[0] = torch.empty(1 << (size - 1).bit_length(), dtype=torch.long,
                                        pin_memory=self._pinned)
        host = self._back[0][:size]
        host.copy_(tokens, non_blocking=self._pinned)
        copied = torch.cuda.Event() if self._pinned else None
        if copied is not None:
            copied.record()
        return host, copied
