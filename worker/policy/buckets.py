"""A length bucket: the requests of similar length waiting for their batch, and how a batch
is taken from it. Pure (the batcher's part that knows one bucket, batching.py the rest).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: policy imports nothing that does I/O (or torch)
    from producer.request_entry import Request
    from worker.models.base import Prepared


@dataclass(slots=True)
class Pending:
    """A request read from the stream and prepared, waiting for its batch."""

    entry_id: str
    request: Request
    item: Prepared
    read_at: float  # monotonic seconds: max_wait_ms counts from here
    seq: int = 0  # arrival order, set by the Batcher
    enqueued_ms: int = 0  # the XADD time (Unix ms, from the entry id; at most the read time)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float


def bucket_of(length: int, boundaries: Sequence[int]) -> int:
    """Index of the first boundary >= length; lengths past the last share one overflow bucket."""
    return bisect_left(boundaries, length)


def take_members(candidates: Sequence[Pending], limits: BatchLimits) -> list[Pending]:
    """Greedy fill in the given order until the request cap or the padded-token cap.

    The first candidate always goes, so an input above the token cap still runs, alone.
    """
    chosen: list[Pending] = []
    longest = 0
    for pending in candidates:
        longest_if_added = max(longest, pending.item.length)
        if chosen and (len(chosen) >= limits.max_batch_size
                       or (len(chosen) + 1) * longest_if_added > limits.max_batch_tokens):
            break
        chosen.append(pending)
        longest = longest_if_added
    return chosen


class Bucket:
    """Requests of similar length, kept in arrival order (so items[0] is the oldest).

    It counts its lengths and its prioritised requests as they come and go, so taking a
    batch costs the batch, not the whole bucket (a bucket can hold `max_inflight` requests).
    Background requests (priority below 0: batch jobs' lines) are counted apart, so a batch
    can be held to a few of them while online requests keep arriving.
    """

    def __init__(self) -> None:
        self.items: list[Pending] = []
        self.longest = 0
        self._lengths: Counter[int] = Counter()
        self._prioritised = 0
        self.background = 0

    def add(self, pending: Pending) -> None:
        self.items.append(pending)
        length = pending.item.length
        self._lengths[length] += 1
        if length > self.longest:
            self.longest = length
        if pending.request.priority:
            self._prioritised += 1
            self.background += pending.request.background

    def background_only(self) -> bool:
        """Only background requests: online buckets go first."""
        return self.background == len(self.items)

    def oldest_read_at(self) -> float:
        return self.items[0].read_at

    def is_full(self, limits: BatchLimits) -> bool:
        n = len(self.items)
        return n >= limits.max_batch_size or n * self.longest >= limits.max_batch_tokens

    def take(self, limits: BatchLimits, background_rows: int | None = None) -> list[Pending]:
        """Remove and return the next batch: highest priority first, then oldest first;
        at most `background_rows` background requests in it, when given."""
        if self._prioritised:
            order = heapq.nsmallest(limits.max_batch_size, self.items,
                                    key=lambda p: (-p.request.priority, p.seq))
            if background_rows is not None:  # the background ones are last in `order`
                online = [p for p in order if not p.request.background]
                order = online + order[len(online):len(online) + background_rows]
            chosen = take_members(order, limits)
            taken = {id(p) for p in chosen}
            self.items = [p for p in self.items if id(p) not in taken]
        else:
            chosen = take_members(self.items, limits)
            del self.items[: len(chosen)]
        self._forget(chosen)
        return chosen

    def take_oldest(self, count: int) -> list[Pending]:
        """Remove and return the `count` oldest, whatever their priority."""
        taken, self.items = self.items[:count], self.items[count:]
        self._forget(taken)
        return taken

    def take_all(self) -> list[Pending]:
        taken, self.items = self.items, []
        self._forget(taken)
        return taken

    def _forget(self, removed: list[Pending]) -> None:
        lengths = self._lengths
        for pending in removed:
            length = pending.item.length
            lengths[length] -= 1
            if not lengths[length]:
                del lengths[length]
            if pending.request.priority:
                self._prioritised -= 1
                self.background -= pending.request.background
        if self.longest not in lengths:
            self.longest = max(lengths, default=0)
