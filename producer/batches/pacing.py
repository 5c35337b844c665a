"""How many lines of a batch may be in flight (additive increase, multiplicative decrease),
and how soon the runner looks at a batch again.
Pure.

Why: a worker shedding over its latency target refuses batch lines at read time; sending
the same window again at once would be refused again, round after round. Each round that
sheds halves the window, each answered line grows it by one (up to the runner's window),
so a batch settles at what the workers take beside the online load.
"""

from __future__ import annotations

from enum import IntEnum


class Pacing:
    def __init__(self, most: int, least: int = 1) -> None:
        self.most, self.least = most, least
        self.window = most

    def settled(self, answered: int, shed: int) -> int:
        """The window after a round of replies: `answered` lines done, `shed` refused."""
        if shed:
            self.window = max(self.least, self.window // 2)
        else:
            self.window = min(self.most, self.window + answered)
        return self.window


def backlog_room(max_backlog: int, busy_backlog: int, backlog: int, queued: int) -> int:
    """How many more lines the model's stream may take, holding `backlog` unacked entries
    of which `queued` are this batch's. While online requests wait beside them, the batch
    keeps at most `busy_backlog` there, so the next batch the workers form holds only a few
    of its lines and online calls wait behind no long one; otherwise the whole backlog may
    be the batch's, up to `max_backlog`."""
    online = backlog - min(max(queued, 0), backlog)
    if online > 0:
        return min(busy_backlog - queued, max_backlog - backlog)
    return max_backlog - backlog


class Moved(IntEnum):
    """What a step of a batch did, which sets how soon the runner looks again."""
    IDLE = 0  # nothing in flight: nothing can move before the next poll
    WAITING = 1  # lines in flight, none answered yet: their replies come within a batch
    MOVED = 2  # lines settled or admitted: the next replies are already due


def movement(changed: bool, queued: int) -> Moved:
    """A step that settled or admitted lines moved; else it waits on `queued` lines in the
    stream or on a worker (their replies come within a batch), or has none to wait on."""
    return Moved.MOVED if changed else Moved.WAITING if queued > 0 else Moved.IDLE


def admission_order(sizes: list[int]) -> list[int]:
    """Line numbers, shortest line first: a window's lines share few length buckets, so the
    workers batch them full (in file order a window of 256 gave 19-row batches, not 27)."""
    return sorted(range(len(sizes)), key=sizes.__getitem__)
