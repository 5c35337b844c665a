"""How background requests (priority < 0: batch jobs' lines) share the device with online
ones. Pure: arrival times and measured compute times in, caps and waits out.

A batch is not preemptible, so while an online request arrived within `quiet_ms`:
- a batch holds at most `rows` background requests (an online call waits behind a short
  batch at most);
- batches of background requests alone take at most `share` of the time: after one that
  computed for t ms, the next waits t x (1 / share - 1) ms. Why: on a CPU the worker, the
  gateway and Redis share the cores, and a worker busy with background batches back to back
  starves the processes that carry the online calls (their p99 grew 20x beside a batch
  before this); a GPU's host is spared the compute, but the device still is not.
Once online traffic is quiet, background batches run as large and as often as they can.
"""

from __future__ import annotations

from dataclasses import dataclass

NEVER = -(1 << 62)


@dataclass(slots=True)
class BackgroundPacing:
    rows: int = 0  # 0: no cap on background rows beside online ones
    quiet_ms: int = 1000
    share: float = 1.0  # 1: background-only batches back to back
    online_ms: int = NEVER  # when the last online request arrived (its XADD time)
    resume_ms: float = NEVER  # no background-only batch before this while online is recent

    def online_arrived(self, enqueued_ms: int) -> None:
        self.online_ms = max(self.online_ms, enqueued_ms)

    def online_recent(self, now_ms: int) -> bool:
        return now_ms - self.online_ms < self.quiet_ms

    def cap(self, now_ms: int) -> int | None:
        """The most background requests a batch formed now may hold (None: no cap)."""
        return self.rows if self.rows and self.online_recent(now_ms) else None

    def held_ms(self, now_ms: int) -> float:
        """How long a batch of background requests alone must still wait (0: it may go)."""
        if not self.online_recent(now_ms):
            return 0.0
        # online quiet by then lifts the hold too
        return max(0.0, min(self.resume_ms, self.online_ms + self.quiet_ms) - now_ms)

    def finished(self, background_only: bool, compute_ms: float, now_ms: int) -> None:
        """A batch computed for `compute_ms`, done at `now_ms`."""
        if background_only and self.share < 1.0:
            self.resume_ms = now_ms + compute_ms * (1.0 / self.share - 1.0)
