"""How background requests (priority < 0: batch jobs' lines) share the device with online
ones. Pure: arrival times and measured compute times in, caps and waits out.

A batch is not preemptible, so while an online request arrived within `quiet_ms`:
- a batch holds at most `rows` background requests (an online call waits behind a short
  batch at most);
- background requests take at most `share` of the time: a batch that computed for t ms
  with a fraction f of its rows background ones holds the next background rows back for
  t x f x (1 / share - 1) ms, both those that would ride in an online batch and batches of
  them alone. Why: on a CPU the worker, the gateway and Redis share the cores, and a worker
  kept busy by background rows starves the processes that carry the online calls (their
  p99 grew 20x beside a batch before this); on a GPU the device is still shared.
Once online traffic is quiet, background batches run as large and as often as they can.

Under a latency target the share is steered (`steer`): it grows while a batch runs and
the online percentile is well under the target, and falls back to the configured share
once it nears it, so a batch takes the headroom a target leaves, and only that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEVER = -(1 << 62)
STEER_MS = 500  # at most one step of the share this often
STEER_GROW = 1.25  # the share's step up while the online percentile is under STEER_ROOM
STEER_ROOM = 0.4  # of the target: the online percentile under this leaves room to grow
STEER_BACK = 0.6  # of the target: over this the share is the configured one again


@dataclass(slots=True)
class BackgroundPacing:
    rows: int = 0  # 0: no cap on background rows beside online ones
    quiet_ms: int = 1000
    share: float = 1.0  # 1: no pacing
    online_ms: int = NEVER  # when the last online request arrived (its XADD time)
    resume_ms: float = NEVER  # no background rows before this while online is recent
    floor: float = field(init=False)  # the configured share, what `steer` falls back to
    steered_ms: float = NEVER
    ran: bool = False  # background rows ran beside online ones since the last steer

    def __post_init__(self) -> None:
        self.floor = self.share

    def online_arrived(self, enqueued_ms: int) -> None:
        self.online_ms = max(self.online_ms, enqueued_ms)

    def online_recent(self, now_ms: int) -> bool:
        return now_ms - self.online_ms < self.quiet_ms

    def cap(self, now_ms: int) -> int | None:
        """The most background requests a batch formed now may hold (None: no cap)."""
        if not self.online_recent(now_ms):
            return None
        if self.held_ms(now_ms) > 0:
            return 0
        return self.rows or None

    def held_ms(self, now_ms: int) -> float:
        """How long background requests must still wait (0: they may go)."""
        if not self.online_recent(now_ms):
            return 0.0
        # online quiet by then lifts the hold too
        return max(0.0, min(self.resume_ms, self.online_ms + self.quiet_ms) - now_ms)

    def finished(self, background: int, rows: int, compute_ms: float, now_ms: int) -> None:
        """A batch of `rows` rows, `background` of them background ones, computed for
        `compute_ms` and done at `now_ms`: their part of it is paid for in rest, only while
        online requests arrive (a batch job run alone must leave no debt for the first
        online call to find: a minute of it once held a new batch back for a minute)."""
        if not (background and self.online_recent(now_ms)):
            return
        self.ran = True
        if self.share < 1.0:
            spent = compute_ms * background / rows
            self.resume_ms = max(self.resume_ms, now_ms) + spent * (1.0 / self.share - 1.0)

    def steer(self, observed_ms: float, target_ms: float, now_ms: float) -> None:
        """Under a latency target: while background rows run beside online ones and the
        online requests' observed percentile is well under it (under STEER_ROOM of it),
        the share grows step by step, up to all of the time; near it (over STEER_BACK), or
        with no background row run since the last step, it is the configured one again.

        Why: the configured share is what holds an online p99 without a target to aim at
        (within ~10 % of its own on a CPU); a target says how much more latency is
        acceptable. A share grown with nothing to pace met the next batch all at once (a
        p99 of 2x a 200 ms target). The thresholds are cautious because the worker's
        percentile leaves out the gateway's part, which batch lines slow too on shared
        cores (at 0.5 / 0.8, 2 rounds of 8 went past a 100 ms target end to end;
        docs/gateway.md)."""
        if now_ms - self.steered_ms < STEER_MS:
            return
        self.steered_ms, ran, self.ran = now_ms, self.ran, False
        if observed_ms > STEER_BACK * target_ms or not ran:
            self.share = self.floor
        elif observed_ms < STEER_ROOM * target_ms:
            self.share = min(1.0, self.share * STEER_GROW)
