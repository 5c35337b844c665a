"""What the pipeline's threads share, under the worker's one lock.

The entries held (read and not yet answered), whether the intake still reads, how many
model instances wait for a batch, and the two conditions on the lock, so each thread wakes
only for what it waits for: `room` (answers written, in-flight slots free) for the intake,
`work` (requests queued, or reading stopped) for the compute loops. The batcher and the
governor are guarded by the same lock; there is no other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from worker.policy.flow import FlowPolicy
from worker.streams.reader import Entry

ROOM_POLL_S = 0.5  # the intake re-checks stopping this often while the cap is reached


class InFlight:
    def __init__(self, lock: threading.Lock, policy: FlowPolicy) -> None:
        self.lock = lock
        self.policy = policy
        self.room = threading.Condition(lock)
        self.work = threading.Condition(lock)
        self.held: set[str] = set()
        self.reading = True
        self.idle = 0  # model instances waiting for a batch

    def wait_for_room(self, draining_own_pending: bool, stopping: threading.Event) -> int:
        """Block until the policy lets the intake read; the number of free slots."""
        with self.lock:
            while self.policy.is_full(len(self.held), draining_own_pending) \
                    and not stopping.is_set():
                self.room.wait(ROOM_POLL_S)
            return self.policy.room(len(self.held))

    def not_held(self, entries: Sequence[Entry]) -> list[Entry]:
        """A redelivered entry we already hold is skipped, not run twice."""
        with self.lock:
            return [e for e in entries if e.id not in self.held]

    def release(self, entry_ids: Iterable[str]) -> None:
        """Answered (or no longer ours): free the slots and wake the intake."""
        with self.lock:
            self.held.difference_update(entry_ids)
            self.room.notify_all()

    def stop_reading(self) -> None:
        with self.lock:
            self.reading = False
            self.work.notify_all()

    def wake_all(self) -> None:
        with self.lock:
            self.room.notify_all()
            self.work.notify_all()

    def should_flush(self) -> bool:
        """Call with the lock held."""
        return self.policy.should_flush(self.reading, len(self.held))
