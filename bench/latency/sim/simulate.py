"""A discrete-event simulator of one worker: the real Batcher and latency policy on a
simulated clock, with seeded Poisson arrivals and a seeded service-time model.

It runs minutes of traffic in seconds, so the latency-target goals are checked in CI
(tests/unit/bench/test_latency_sim.py) and every baseline runs on the very same arrivals
(bench/latency/sim/baselines.py). Written by hand: the event loop is a heap of completion times, and
no simulation library fitted a policy object that is called, not scheduled.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from producer.protocol import MSGPACK
from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.batching import Batch, Pending

EPOCH_MS = 1_700_000_000_000  # simulated Unix time of t = 0


@dataclass(frozen=True, slots=True)
class Phase:
    seconds: float
    rate_per_s: float
    slowdown: float = 1.0  # the device's service time is multiplied by this (drift)


@dataclass(frozen=True, slots=True)
class Arrival:
    at_ms: float  # since the start
    length: int
    deadline_ms: float | None = None  # since the start


@dataclass(frozen=True, slots=True)
class ServiceCost:
    """A device: fixed ms per batch plus ms per padded token, with relative noise."""

    fixed_ms: float
    per_token_ms: float
    jitter: float = 0.05  # standard deviation, relative

    def sample(self, size: int, longest: int, slowdown: float, rng: random.Random) -> float:
        mean = (self.fixed_ms + self.per_token_ms * size * longest) * slowdown
        return max(0.1, mean * (1.0 + rng.gauss(0.0, self.jitter)))


def poisson_arrivals(phases: Sequence[Phase], length: Callable[[random.Random], int],
                     seed: int, deadline_ms: float | None = None) -> list[Arrival]:
    """Arrivals of a piecewise-constant rate; `deadline_ms`: each carries arrival + this."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    start = 0.0
    for phase in phases:
        t, end = start, start + phase.seconds * 1000
        while phase.rate_per_s > 0:
            t += rng.expovariate(phase.rate_per_s / 1000)
            if t >= end:
                break
            arrivals.append(Arrival(t, length(rng),
                                    None if deadline_ms is None else t + deadline_ms))
        start = end
    return arrivals


@dataclass(slots=True)
class Outcome:
    arrived_ms: float
    done_ms: float
    status: str  # ok, refused, deadline_exceeded
    bucket: int = 0

    @property
    def latency_ms(self) -> float:
        return self.done_ms - self.arrived_ms


class Dispatcher(Protocol):
    """A batching policy as the simulator drives it (bench/latency/sim/baselines.py has several)."""

    def add(self, pending: Pending, now_ms: float) -> str | None:
        """Queue a request, or return the error code it is refused with at once."""

    def next_batch(self, now_ms: float, instance: int, busy: bool) -> Batch | None: ...

    def wake_in_ms(self, now_ms: float) -> float | None: ...

    def started(self, instance: int, batch: Batch, now_ms: float) -> None: ...

    def finished(self, instance: int, batch: Batch, service_ms: float, now_ms: float,
                 latencies_ms: list[float]) -> None: ...


def as_pending(arrival: Arrival, seq: int) -> Pending:
    deadline = None if arrival.deadline_ms is None else int(EPOCH_MS + arrival.deadline_ms)
    request = Request(f"r{seq}", b"", MSGPACK, "reply", deadline, 0)
    entry_id = f"{int(EPOCH_MS + arrival.at_ms)}-{seq}"
    return Pending(entry_id, request, Prepared(arrival.length, seq), read_at=arrival.at_ms / 1000)


@dataclass
class Simulation:
    dispatcher: Dispatcher
    cost: ServiceCost
    phases: Sequence[Phase]
    instances: int = 1
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def slowdown_at(self, t_ms: float) -> float:
        start = 0.0
        for phase in self.phases:
            start += phase.seconds * 1000
            if t_ms < start:
                return phase.slowdown
        return self.phases[-1].slowdown

    def run(self, arrivals: Sequence[Arrival]) -> list[Outcome]:
        """Every arrival to its outcome; returns the outcomes."""
        self._rng = random.Random(self.seed)
        self._completions: list[tuple[float, int, int, Batch, float]] = []
        self._idle = list(range(self.instances))
        self._arrived: dict[str, float] = {}
        self._tiebreak = 0
        index, wake = 0, math.inf
        while True:
            next_arrival = arrivals[index].at_ms if index < len(arrivals) else math.inf
            next_done = self._completions[0][0] if self._completions else math.inf
            now = min(next_arrival, next_done, wake)
            if now == math.inf:
                return self.outcomes
            if now == next_done:
                _, _, instance, batch, service = heapq.heappop(self._completions)
                self._complete(instance, batch, service, now)
                self._idle.append(instance)
            elif now == next_arrival:
                self._arrive(arrivals[index], index, now)
                index += 1
            self._dispatch(now)
            wait = self.dispatcher.wake_in_ms(now) if self._idle else None
            wake = math.inf if wait is None else now + max(wait, 0.05)

    def _arrive(self, arrival: Arrival, seq: int, now: float) -> None:
        pending = as_pending(arrival, seq)
        self._arrived[pending.entry_id] = arrival.at_ms
        refused = self.dispatcher.add(pending, now)
        if refused:
            self._arrived.pop(pending.entry_id)
            self.outcomes.append(Outcome(now, now, refused))

    def _dispatch(self, now: float) -> None:
        """Idle instances take batches while the policy sends them."""
        while self._idle:
            batch = self.dispatcher.next_batch(now, self._idle[-1], busy=False)
            if batch is None:
                return
            self._expire(batch, now)
            if not batch.members:
                continue
            instance = self._idle.pop()
            service = self.cost.sample(len(batch.members), batch.longest,
                                       self.slowdown_at(now), self._rng)
            self.dispatcher.started(instance, batch, now)
            self._tiebreak += 1
            heapq.heappush(self._completions,
                           (now + service, self._tiebreak, instance, batch, service))

    def _expire(self, batch: Batch, now: float) -> None:
        for pending in batch.expired:
            self.outcomes.append(Outcome(self._arrived.pop(pending.entry_id), now,
                                         "deadline_exceeded", batch.bucket))

    def _complete(self, instance: int, batch: Batch, service: float, now: float) -> None:
        latencies = []
        for pending in batch.members:
            start = self._arrived.pop(pending.entry_id)
            self.outcomes.append(Outcome(start, now, "ok", batch.bucket))
            latencies.append(now - start)
        self.dispatcher.finished(instance, batch, service, now, latencies)
