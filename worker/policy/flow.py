"""Flow policy: how much the intake may read, when to flush, claim or read, and yield.

These are the decisions the pipeline's threads make around the batcher, taken out of them
so each is a plain function of counts and flags, unit-tested without threads or Redis.
The pipeline calls them under its one lock and acts on the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FlowPolicy:
    """The in-flight cap and the read size: `max_inflight` entries may be held between
    reading and answering (other workers in the group get the rest); a read asks for at
    most `read_count` of them."""

    max_inflight: int
    read_count: int

    def is_full(self, held: int, draining_own_pending: bool) -> bool:
        """No room to read. While own pending entries are drained, each runs alone: one of
        them may be the poison that crashed the last process, and must crash nothing else."""
        if draining_own_pending:
            return held > 0
        return held >= self.max_inflight

    def room(self, held: int) -> int:
        """Free in-flight slots (never negative)."""
        return max(0, self.max_inflight - held)

    def read_size(self, room: int) -> int:
        """How many entries one read asks for, given the room."""
        return min(room, self.read_count)

    def should_flush(self, reading: bool, held: int) -> bool:
        """Dispatch without waiting for a batch to fill: nothing more can arrive, because
        reading has stopped or the in-flight cap is reached."""
        return not reading or held >= self.max_inflight


def claims_first(sweep_due: bool, draining_own_pending: bool) -> bool:
    """Claim other consumers' idle entries before reading, when a sweep is due; never while
    draining our own pending entries (one at a time, alone)."""
    return sweep_due and not draining_own_pending


def yields_to_idle(blocking: bool, idle_instances: int) -> bool:
    """A busy model instance looking ahead (not blocking) leaves the next batch to an idle
    one, which can start it now rather than after the current batch."""
    return not blocking and idle_instances > 0


def entry_time_ms(entry_id: str) -> int:
    """Redis stream ids start with the XADD time in Unix milliseconds."""
    return int(entry_id.partition("-")[0])


def arrival_ms(entry_id: str, now_ms: float) -> int:
    """A request's arrival: its XADD time, but never after now. A producer may XADD with an
    explicit id in the future, and every later id of that stream then takes its time: read
    as is, every request would look as if it had not waited at all."""
    return min(entry_time_ms(entry_id), int(now_ms))


def queue_waits_ms(started_ms: float, enqueued_ms: Sequence[int]) -> list[float]:
    """Each member's wait from its XADD to its batch's launch, in ms (never negative).

    In whole µs: an integer division each, where round(x, 3) cost more than the rest of an
    answer (and the XADD time is whole ms anyway).
    """
    started_us = round(started_ms * 1000)
    return [max(0, started_us - enqueued * 1000) / 1000 for enqueued in enqueued_ms]


def end_to_end_s(written_ms: float, enqueued_ms: Sequence[int]) -> list[float]:
    """Each answer's time from its XADD to its reply being written, in seconds."""
    return [max(0.0, written_ms - enqueued) / 1000 for enqueued in enqueued_ms]


def is_past_deadline(deadline_ms: int | None, now_ms: int) -> bool:
    """A request whose absolute deadline (Unix ms) has come is answered without compute."""
    return deadline_ms is not None and deadline_ms <= now_ms
