"""The batcher's buckets seen through the latency policy: which bucket leaves next, with
how many members, and whether a new request can still be served in time.

Batcher's dispatch rule (batching.DispatchRule) when `latency_target_ms` is set, and the
simulator's. Pure, like the rest of policy/: times are passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from worker.policy.batching import Batch, Bucket, Pending, bucket_of, take_members
from worker.policy.flow import entry_time_ms
from worker.policy.latency import Admission, Decision, LatencyPolicy, Member

if TYPE_CHECKING:
    from worker.policy.batching import Batcher, BatchLimits


def member(pending: Pending) -> Member:
    enqueued = pending.enqueued_ms or entry_time_ms(pending.entry_id)  # not yet queued
    return Member(enqueued, pending.request.deadline_ms, pending.item.length)


def candidates(bucket: Bucket, limits: BatchLimits) -> tuple[list[Pending], str | None]:
    """The largest batch the caps allow, oldest first, and which cap ended it (if any)."""
    chosen = take_members(bucket.items, limits)
    if len(chosen) < len(bucket.items) or bucket.is_full(limits):
        capped = "full" if len(chosen) >= limits.max_batch_size else "token_cap"
        return chosen, capped
    return chosen, None


@dataclass
class TargetedDispatch:
    """`policy` predicts for admission always; Batcher dispatches through this object only
    when a latency target is set."""

    policy: LatencyPolicy

    def arrived(self, index: int, pending: Pending) -> None:
        self.policy.arrived(index, pending.enqueued_ms)

    def finished(self, batch: Batch, service_ms: float) -> None:
        """Nothing more: the compute loop tells `policy` of every batch, target or not."""

    def checks(self, pending: Pending) -> bool:
        """Whether admission has anything to decide: a deadline, or shedding on."""
        return pending.request.deadline_ms is not None or self.policy.shed_over_target

    def decide(self, batcher: Batcher, index: int, now_ms: float, flush: bool,
               start_in_ms: float) -> Decision:
        bucket = batcher.buckets[index]
        chosen, capped = candidates(bucket, batcher.limits_of(index))
        decision = self.policy.decide(index, [member(p) for p in chosen], capped, now_ms,
                                      start_in_ms, len(bucket.items))
        if flush and not decision.ready:
            return replace(decision, ready=True, reason="flush")
        return decision

    def next_batch(self, batcher: Batcher, now_ms: int, flush: bool,
                   start_in_ms: float) -> Batch | None:
        """Of the buckets ready to leave, the one with the least slack goes first (earliest
        deadline first, so no bucket starves); it absorbs other whole buckets within its
        slack (keeps_slack)."""
        ready, held = [], batcher.background.held_ms(now_ms) > 0
        for index, bucket in enumerate(batcher.buckets):
            if bucket.items and not (held and bucket.background_only()):
                decision = self.decide(batcher, index, now_ms, flush, start_in_ms)
                if decision.ready:
                    ready.append((bucket.background_only(), bucket.items[0].enqueued_ms,
                                  index, decision))
        if not ready:
            return None
        _, _, index, decision = min(ready, key=lambda r: r[:3])
        limits = batcher.limits_of(index)
        taken = batcher.buckets[index].take(replace(limits, max_batch_size=decision.size),
                                            batcher.background_cap)
        if taken:
            taken += batcher.absorb(index, taken, limits,
                                    self.keeps_slack(index, taken, decision.slack_ms))
        batch = batcher.emit(index, taken, now_ms, decision.reason, decision.slack_ms)
        if batch.members:
            self.policy.dispatched(index, len(batch.members), batch.longest,
                                   now_ms + start_in_ms)
        return batch

    def keeps_slack(self, index: int, taken: list[Pending],
                    slack_ms: float) -> Callable[[int, int], bool] | None:
        """Whether a merged batch of (size, longest) still meets the earliest deadline of
        `taken`: other buckets are absorbed, as the static batcher does when one forward
        pass costs less than two, only while the predicted extra time fits the slack.
        While the observed percentile is over the target (None: no check beyond the
        batcher's own) they are absorbed as the static batcher does: the device is behind,
        and a forward pass saved is what catches it up."""
        if self.policy.margin.over_target():
            return None
        alone = self.policy.model.predict_ms(index, len(taken),
                                             max(p.item.length for p in taken))

        def keeps(size: int, longest: int) -> bool:
            return self.policy.model.predict_ms(index, size, longest) - alone <= slack_ms
        return keeps

    def seconds_until_ready(self, batcher: Batcher, now_ms: int) -> float | None:
        held_ms = batcher.background.held_ms(now_ms)
        waits = [max(0.0 if d.ready else d.wait_ms or 0.0,
                     held_ms if bucket.background_only() else 0.0)
                 for index, bucket in enumerate(batcher.buckets) if bucket.items
                 for d in [self.decide(batcher, index, now_ms, False, 0.0)]]
        return min(waits) / 1000 if waits else None

    def admit(self, batcher: Batcher, pending: Pending, now_ms: float) -> Admission:
        """Whether a request just read can be served in time, given the queue ahead."""
        index = bucket_of(pending.item.length, batcher.boundaries)
        queued = sum(self.policy.queued_ms(i, len(b.items), b.longest,
                                           batcher.limits_of(i).max_batch_size)
                     for i, b in enumerate(batcher.buckets))
        cap = batcher.limits_of(index).max_batch_size
        joins = len(batcher.buckets[index].items) % cap + 1  # its own batch, as it fills
        return self.policy.admit(member(pending), index, now_ms, queued, joins)
