"""BentoML's CorkDispatcher (issue 13, baseline 5): a BASELINE for comparison with
redbatch's latency target, not a recommended mode.

Its rule, on one FIFO queue (no length buckets): fit latency = a·n + b by least squares
over the last 50 batches; refuse, the oldest first, while the oldest's age + a·n + b ≥
the target (n: the queue's length; the last one is kept); wait while n < cap and
n·(age of the newest + a) ≤ 0.95 × the mean wait (an EWMA of the oldest member's age at
dispatch); otherwise dispatch up to cap, the oldest first.

`CorkRule` is the one implementation, run by the simulator (bench/latency/sim/baselines.py)
and by the worker (`batch_controller = "cork"`, through `CorkDispatch`). Pure, like the rest of
policy/: times are passed in, as ms.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.policy.batching import Batch, Pending, bucket_of, take_members

if TYPE_CHECKING:
    from worker.policy.batching import Batcher

HISTORY = 50  # batches the latency fit looks back over
WAIT_SHARE = 0.95  # waiting pays while the wait it adds is under this share of the mean
WAIT_KEEP, WAIT_GAIN = 0.9, 0.1  # the mean wait's EWMA: old and new shares per dispatch
TICK_MS = 1.0  # BentoML polls on a 1 ms tick: the worker never sleeps shorter


def least_squares(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Slope and intercept of latency = a·n + b, neither below 0."""
    count = len(points)
    mean_n = sum(n for n, _ in points) / count
    mean_t = sum(t for _, t in points) / count
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    if spread == 0:
        return 0.0, mean_t
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread
    return max(0.0, slope), max(0.0, mean_t - slope * mean_n)


@dataclass(frozen=True, slots=True)
class CorkDecision:
    """How many of the queue, the oldest first, to refuse, then how many to dispatch
    (0: wait)."""

    refuse: int
    take: int


class CorkRule:
    """The dispatcher's state (the fit, the mean wait) and its three tests. `arrivals`:
    the queue's arrival times, the oldest first, in the same ms as `now_ms`."""

    def __init__(self, target_ms: float, max_batch_size: int, history: int = HISTORY) -> None:
        self.target_ms, self.max_batch_size = target_ms, max_batch_size
        self.batches: deque[tuple[int, float]] = deque(maxlen=history)
        self.per_item, self.fixed, self.mean_wait = 0.0, 0.0, 0.0

    def refusals(self, now_ms: float, arrivals: Sequence[float]) -> int:
        """How many, the oldest first, are predicted to finish past the target."""
        refused, count = 0, len(arrivals)
        while count - refused > 1 and (now_ms - arrivals[refused]
                                       + self.per_item * (count - refused)
                                       + self.fixed) >= self.target_ms:
            refused += 1
        return refused

    def waits(self, queued: int, newest_age_ms: float) -> bool:
        """Whether waiting for one more still pays, by BentoML's rule (never once a batch
        is full)."""
        return queued < self.max_batch_size and \
            queued * (newest_age_ms + self.per_item) <= WAIT_SHARE * self.mean_wait

    def dispatched(self, oldest_age_ms: float) -> None:
        """A batch left: its oldest member's age moves the mean wait."""
        self.mean_wait = WAIT_KEEP * self.mean_wait + WAIT_GAIN * oldest_age_ms

    def finished(self, size: int, service_ms: float) -> None:
        """A batch of `size` took `service_ms`: refit a and b (from the second batch on)."""
        self.batches.append((size, service_ms))
        if len(self.batches) >= 2:
            self.per_item, self.fixed = least_squares(self.batches)

    def decide(self, now_ms: float, arrivals: Sequence[float],
               flush: bool = False) -> CorkDecision:
        """Refuse the late, then wait or dispatch (at once when `flush`: nothing more can
        come); a dispatch moves the mean wait."""
        if not arrivals:
            return CorkDecision(0, 0)
        refuse = self.refusals(now_ms, arrivals)
        queued = len(arrivals) - refuse
        if not flush and self.waits(queued, now_ms - arrivals[-1]):
            return CorkDecision(refuse, 0)
        self.dispatched(now_ms - arrivals[refuse])
        return CorkDecision(refuse, min(queued, self.max_batch_size))

    def wait_ms(self, now_ms: float, arrivals: Sequence[float]) -> float | None:
        """How long until the decision can change without a new arrival: the wait stops
        paying, or the oldest becomes late. Never under BentoML's tick (the tick when a
        full batch is due now); None when empty."""
        if not arrivals:
            return None
        count = len(arrivals)
        until: list[float] = []
        if count < self.max_batch_size:
            until.append(WAIT_SHARE * self.mean_wait / count - self.per_item
                         - (now_ms - arrivals[-1]))
        if count > 1:
            until.append(self.target_ms - self.per_item * count - self.fixed
                         - (now_ms - arrivals[0]))
        return max(TICK_MS, min(until, default=TICK_MS))

    def retry_after_ms(self, queued: int) -> int:
        """What a refused request is told: the predicted time to serve the queue left."""
        return int(self.per_item * queued + self.fixed) + 1


class CorkDispatch:
    """The worker's hook (batching.DispatchRule): the batcher's buckets as one FIFO queue,
    in arrival order, under CorkRule. Refused requests leave in `Batch.refused`."""

    def __init__(self, rule: CorkRule) -> None:
        self.rule = rule

    def arrived(self, index: int, pending: Pending) -> None:
        """Nothing to note: the queue is the buckets themselves."""

    def next_batch(self, batcher: Batcher, now_ms: int, flush: bool,
                   start_in_ms: float) -> Batch | None:
        """The oldest (refused, then dispatched) as one batch; a batch of refusals alone
        when the rest waits; None when nothing leaves."""
        queue = fifo(batcher)
        decision = self.rule.decide(now_ms, [p.enqueued_ms for p in queue], flush)
        if not decision.refuse and not decision.take:
            return None
        refused = queue[:decision.refuse]
        candidates = queue[decision.refuse:decision.refuse + decision.take]
        index = bucket_of(max((p.item.length for p in candidates), default=0),
                          batcher.boundaries)
        taken = take_members(candidates, batcher.limits_of(index)) if candidates else []
        leaving = Counter(bucket_of(p.item.length, batcher.boundaries) for p in refused + taken)
        for bucket, count in leaving.items():  # the queue's head: each bucket's oldest
            batcher.buckets[bucket].take_oldest(count)
        batch = batcher.emit(index, taken, now_ms, dispatch_reason(flush, taken, candidates,
                                                                   self.rule.max_batch_size),
                             refused=refused)
        batch.retry_after_ms = self.rule.retry_after_ms(len(queue) - len(refused))
        return batch

    def seconds_until_ready(self, batcher: Batcher, now_ms: int) -> float | None:
        wait = self.rule.wait_ms(now_ms, [p.enqueued_ms for p in fifo(batcher)])
        return None if wait is None else wait / 1000

    def finished(self, batch: Batch, service_ms: float) -> None:
        if batch.members:
            self.rule.finished(len(batch.members), service_ms)


def dispatch_reason(flush: bool, taken: Sequence[Pending], candidates: Sequence[Pending],
                    cap: int) -> str:
    """Why the batch left, in the labels of the other dispatchers (timer: the wait stopped
    paying)."""
    if flush:
        return "flush"
    if len(taken) < len(candidates):
        return "token_cap"
    return "full" if len(taken) >= cap else "timer"


def fifo(batcher: Batcher) -> list[Pending]:
    """Every queued request, the oldest first, whatever its bucket (each bucket is already
    in arrival order, so a merge, not a sort)."""
    return list(heapq.merge(*(bucket.items for bucket in batcher.buckets),
                            key=lambda p: p.seq))
