"""Batching policy: length buckets and the decision of which batch goes next.

Pure logic with no Redis and no model, so every rule here is unit-tested directly. The
worker holds a Batcher under its one lock; times are passed in (monotonic seconds, Unix ms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from worker.policy.background import BackgroundPacing
from worker.policy.buckets import BatchLimits, Bucket, Pending, bucket_of, take_members
from worker.policy.flow import entry_time_ms

__all__ = ["Batch", "BatchLimits", "Batcher", "Bucket", "DispatchRule", "Pending", "bucket_of",
           "take_members"]


@dataclass(slots=True)
class Batch:
    bucket: int
    members: list[Pending]
    expired: list[Pending] = field(default_factory=list)
    reason: str = "timer"  # why it left: full, token_cap, deadline, wait_paid_off, timer
    slack_ms: float | None = None  # with a latency target: time in hand at dispatch
    refused: list[Pending] = field(default_factory=list)  # cork: `overloaded`, not computed
    retry_after_ms: int = 0  # what the refused are told
    # (members list, its size, its longest): asked for about five times a batch
    _longest: tuple[int, int, int] = field(default=(0, -1, 0), repr=False, compare=False)

    @property
    def longest(self) -> int:
        members = self.members
        if self._longest[:2] != (id(members), len(members)):  # members were added or replaced
            self._longest = (id(members), len(members),
                             max((p.item.length for p in members), default=0))
        return self._longest[2]

    @property
    def padded_tokens(self) -> int:
        return len(self.members) * self.longest

    @property
    def real_tokens(self) -> int:
        return sum(p.item.length for p in self.members)


def added_padding(size: int, longest: int, other_size: int, other_longest: int) -> int:
    """Padded tokens one merged batch holds beyond the two batches run apart."""
    merged = (size + other_size) * max(longest, other_longest)
    return merged - size * longest - other_size * other_longest


def fits(size: int, longest: int, limits: BatchLimits) -> bool:
    return size <= limits.max_batch_size and size * longest <= limits.max_batch_tokens


class DispatchRule(Protocol):
    """What decides, instead of max_wait, when and what the buckets send: redbatch's latency
    target (targeted.py) or the cork baseline (cork.py). Called under the worker's lock."""

    def arrived(self, index: int, pending: Pending) -> None: ...

    def next_batch(self, batcher: Batcher, now_ms: int, flush: bool,
                   start_in_ms: float) -> Batch | None: ...

    def seconds_until_ready(self, batcher: Batcher, now_ms: int) -> float | None: ...

    def finished(self, batch: Batch, service_ms: float) -> None:
        """A batch the rule sent was computed in `service_ms`."""
        ...


class Batcher:
    """Length-bucketed dynamic batching.

    A bucket is ready when its next batch is full (requests or padded tokens) or its oldest
    request has waited `max_wait_s`. Among ready buckets the one holding the oldest request
    goes first, so no bucket starves (one of background requests alone goes after any with
    an online request); within a bucket higher priority goes first.
    `caps`, when given, supplies each bucket's limits (the memory governor's caps).

    A batch that leaves before it is full absorbs whole other buckets while that is cheaper
    than running them apart: merging saves a forward pass, worth `merge_tokens` padded
    tokens (the model's fixed cost per batch over its cost per padded token), and costs the
    padding it adds. Under light load requests spread thinly over many fine buckets, and one
    batch of them beats several of one; at saturation batches leave full and stay apart.

    Background requests (priority below 0, batch jobs' lines) fill what online traffic
    leaves (background.py): while online requests keep arriving, a batch holds a few of
    them and absorbs no bucket holding any, and batches of them alone are paced to a share
    of the time; once online traffic is quiet, background batches are as large as the
    limits allow.
    """

    def __init__(self, boundaries: Sequence[int], limits: BatchLimits,
                 caps: Callable[[int], BatchLimits] | None = None,
                 merge_tokens: int = 0, targeted: DispatchRule | None = None,
                 background_rows: int = 0, background_quiet_ms: int = 1000,
                 background_share: float = 1.0) -> None:
        """`targeted`: a rule that dispatches for a latency target instead of by max_wait
        (targeted.py; or the cork baseline's, cork.py). `background_rows` 0: no cap."""
        self.boundaries = list(boundaries)
        self.limits = limits
        self.caps = caps
        self.merge_tokens = merge_tokens
        self.targeted = targeted
        self.background = BackgroundPacing(background_rows, background_quiet_ms,
                                           background_share)
        self.buckets = [Bucket() for _ in range(len(self.boundaries) + 1)]
        self._seq = 0
        self._size = 0
        self.background_cap: int | None = None  # the cap of the batch being formed

    def __len__(self) -> int:
        return self._size

    def add(self, pending: Pending) -> int:
        """Queue a prepared request; returns its bucket index."""
        self._seq += 1
        pending.seq = self._seq
        pending.enqueued_ms = pending.enqueued_ms or entry_time_ms(pending.entry_id)
        index = bucket_of(pending.item.length, self.boundaries)
        self.buckets[index].add(pending)
        self._size += 1
        if not pending.request.background:
            self.background.online_arrived(pending.enqueued_ms)
        if self.targeted is not None:
            self.targeted.arrived(index, pending)
        return index

    def limits_of(self, index: int) -> BatchLimits:
        return self.caps(index) if self.caps is not None else self.limits

    def _is_ready(self, index: int, now: float, flush: bool) -> bool:
        bucket = self.buckets[index]
        return bool(bucket.items) and (
            flush or bucket.is_full(self.limits_of(index))
            or now - bucket.oldest_read_at() >= self.limits.max_wait_s)

    def next_batch(self, now: float, now_ms: int, flush: bool = False,
                   start_in_ms: float = 0.0) -> Batch | None:
        """The batch to run now, or None if no bucket is ready.

        `flush` dispatches without waiting (nothing more can arrive: the in-flight cap is
        reached, or the worker is shutting down). Members past their deadline are moved to
        `expired`, to be answered without compute; a batch may then have no members.
        `start_in_ms`: how long until the asking instance is free (latency target only).
        """
        self.background_cap = self.background.cap(now_ms)
        if self.targeted is not None:
            return self.targeted.next_batch(self, now_ms, flush, start_in_ms)
        held = self.background.held_ms(now_ms) > 0
        ready = [(b.background_only(), b.oldest_read_at(), i)
                 for i, b in enumerate(self.buckets) if self._is_ready(i, now, flush)
                 and not (held and b.background_only())]
        if not ready:
            return None
        *_, index = min(ready)
        limits = self.limits_of(index)
        reason = "full" if self.buckets[index].is_full(limits) else "flush" if flush else "timer"
        taken = self.buckets[index].take(limits, self.background_cap)
        taken += self.absorb(index, taken, limits)
        return self.emit(index, taken, now_ms, reason)

    def emit(self, index: int, taken: list[Pending], now_ms: int, reason: str = "timer",
             slack_ms: float | None = None, refused: Sequence[Pending] = ()) -> Batch:
        """The batch of what was taken from the buckets, its expired members set apart
        (`refused`, also taken, are answered `overloaded`)."""
        self._size -= len(taken) + len(refused)
        batch = Batch(index, [], reason=reason, slack_ms=slack_ms, refused=list(refused))
        for pending in taken:
            deadline = pending.request.deadline_ms
            alive = deadline is None or deadline > now_ms
            (batch.members if alive else batch.expired).append(pending)
        return batch

    def absorb(self, index: int, members: list[Pending], limits: BatchLimits,
               accept: Callable[[int, int], bool] | None = None) -> list[Pending]:
        """Whole other buckets, the cheapest to merge first, while each adds at most
        `merge_tokens` padded tokens, the batch stays within its caps and `accept` (given
        the merged size and longest length) agrees."""
        size, longest = len(members), max(p.item.length for p in members)
        capped = self.background_cap is not None  # then no bucket holding background ones
        extra: list[Pending] = []
        while True:
            merges = [(added_padding(size, longest, len(b.items), b.longest), j)
                      for j, b in enumerate(self.buckets)
                      if j != index and b.items and not (capped and b.background)
                      and fits(size + len(b.items), max(longest, b.longest), limits)]
            if not merges:
                return extra
            padding, j = min(merges)
            merged = (size + len(self.buckets[j].items), max(longest, self.buckets[j].longest))
            if padding > self.merge_tokens or (accept is not None and not accept(*merged)):
                return extra
            size, longest = merged
            extra += self.buckets[j].take_all()

    def seconds_until_ready(self, now: float, now_ms: int = 0) -> float | None:
        """How long until some bucket's oldest request reaches max_wait (with a latency
        target: until some bucket must leave); None when empty."""
        if self.targeted is not None:
            return self.targeted.seconds_until_ready(self, now_ms)
        held_s = self.background.held_ms(now_ms) / 1000
        waits = [max(b.oldest_read_at() + self.limits.max_wait_s - now,
                     held_s if b.background_only() else 0.0)
                 for b in self.buckets if b.items]
        return max(0.0, min(waits)) if waits else None

    def finished(self, batch: Batch, compute_ms: float, now_ms: int) -> None:
        """A batch computed: the time its background rows took paces the next ones."""
        background = sum(p.request.background for p in batch.members)
        self.background.finished(background, len(batch.members), compute_ms, now_ms)
