"""Baseline batch controllers: the adaptive schemes redbatch's latency target is compared
against (issue 13), as controllers of the batching limits. Each is told of every finished
batch and moves the batch cap or the wait; none refuses a request, none looks ahead.
(Baseline 5, BentoML's CorkDispatcher, decides each dispatch and refuses: it is a
dispatch rule, cork.py; `dispatch_rule` below plugs it into the Batcher.)

One implementation runs in the simulator (bench/latency/sim/baselines.py) and in the worker
(`batch_controller`): they are there for comparison, not as recommended modes. In the
worker a new limit holds from the batch after next (a compute loop takes batch N+1 while
N runs). Pure policy, like batching.py: service times and latencies are passed in, as ms.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from worker.policy.batching import BatchLimits, DispatchRule
from worker.policy.cork import CorkDispatch, CorkRule
from worker.policy.service_time import WindowQuantile

if TYPE_CHECKING:
    from worker.settings import Settings

DECREASE = 0.9  # AIMD's multiplicative decrease, as in Clipper
STEP_BANDS = (0.7, 1.2)  # the step controller grows below 0.7 x target, shrinks above 1.2 x
TIMEOUT_FLOOR_MS = 10.0


@dataclass(frozen=True, slots=True)
class Controlled:
    """The limits a controller sets: the most requests per batch, how long one may wait."""

    max_batch_size: int
    max_wait_s: float


class BatchController(Protocol):
    limits: Controlled

    def observe(self, service_ms: float, latencies_ms: Sequence[float]) -> Controlled:
        """A batch finished: its service time and its members' end-to-end latencies."""
        ...


class AimdController:
    """Clipper's AIMD on the batch cap: + `step` while the p99 of the last `window` batch
    service times is under the target, x 0.9 when over. It starts at 1 and never exceeds
    `ceiling`; it leaves the wait alone (Clipper dispatches at once: max_wait_s 0)."""

    def __init__(self, target_ms: float, ceiling: int, max_wait_s: float = 0.0,
                 step: int = 2, window: int = 50) -> None:
        self.target_ms, self.ceiling, self.step = target_ms, ceiling, step
        self.cap = 1.0  # fractional, so that x 0.9 from a small cap still moves it
        self.batch_p99 = WindowQuantile(0.99, window)
        self.limits = Controlled(1, max_wait_s)

    def observe(self, service_ms: float, latencies_ms: Sequence[float]) -> Controlled:
        self.batch_p99.add(service_ms)
        over = self.batch_p99.value(0.0) > self.target_ms
        self.cap = max(1.0, self.cap * DECREASE) if over else min(self.ceiling,
                                                                   self.cap + self.step)
        self.limits = replace(self.limits, max_batch_size=int(self.cap))
        return self.limits


class StepController:
    """The batch cap ± 2 per batch on the p99 of the last `window` end-to-end latencies:
    down above 1.2 x the target, up below 0.7 x, held between. It starts at half the
    ceiling; it leaves the wait alone."""

    def __init__(self, target_ms: float, ceiling: int, max_wait_s: float = 0.0,
                 step: int = 2, window: int = 500) -> None:
        self.target_ms, self.ceiling, self.step = target_ms, ceiling, step
        self.p99 = WindowQuantile(0.99, window)
        self.limits = Controlled(max(1, ceiling // 2), max_wait_s)

    def observe(self, service_ms: float, latencies_ms: Sequence[float]) -> Controlled:
        for latency in latencies_ms:
            self.p99.add(latency)
        observed, cap = self.p99.value(0.0), self.limits.max_batch_size
        low, high = STEP_BANDS
        if observed > high * self.target_ms:
            cap = max(1, cap - self.step)
        elif observed < low * self.target_ms:
            cap = min(self.ceiling, cap + self.step)
        self.limits = replace(self.limits, max_batch_size=cap)
        return self.limits


class DynamicTimeout:
    """The wait = max(10 ms, 2 x the mean end-to-end latency of the last `window` answers);
    the batch cap stays at `ceiling`. It starts at the floor."""

    def __init__(self, ceiling: int, floor_ms: float = TIMEOUT_FLOOR_MS,
                 window: int = 500) -> None:
        self.floor_ms = floor_ms
        self.recent: deque[float] = deque(maxlen=window)
        self.limits = Controlled(ceiling, floor_ms / 1000)

    def observe(self, service_ms: float, latencies_ms: Sequence[float]) -> Controlled:
        self.recent.extend(latencies_ms)
        mean = sum(self.recent) / len(self.recent) if self.recent else 0.0
        self.limits = replace(self.limits, max_wait_s=max(self.floor_ms, 2 * mean) / 1000)
        return self.limits


def with_controlled(limits: BatchLimits, controlled: Controlled) -> BatchLimits:
    """`limits` with the controller's batch cap and wait (the token cap stays)."""
    return replace(limits, max_batch_size=controlled.max_batch_size,
                   max_wait_s=controlled.max_wait_s)


class ControlledCaps:
    """The Batcher's caps provider under a controller: the memory governor's caps for the
    bucket, with the request cap lowered to the controller's (the lower of the two holds)."""

    def __init__(self, caps: Callable[[int], BatchLimits], controller: BatchController) -> None:
        self.caps, self.controller = caps, controller

    def __call__(self, bucket: int) -> BatchLimits:
        limits, cap = self.caps(bucket), self.controller.limits.max_batch_size
        return limits if limits.max_batch_size <= cap else replace(limits, max_batch_size=cap)


def controller_from_settings(settings: Settings) -> BatchController | None:
    """The worker's `batch_controller` (None: static batching, as without one). The cap
    never exceeds max_batch_size; AIMD and step start from max_wait_ms."""
    kind, ceiling = settings.batch_controller, settings.max_batch_size
    wait_s, target = settings.max_wait_ms / 1000, settings.controller_target_ms or 0.0
    builders: dict[str, Callable[[], BatchController]] = {
        "aimd": lambda: AimdController(target, ceiling, wait_s),
        "step": lambda: StepController(target, ceiling, wait_s),
        "dynamic_timeout": lambda: DynamicTimeout(ceiling),
    }
    return builders[kind]() if kind in builders else None


def controlled(limits: BatchLimits, caps: Callable[[int], BatchLimits],
               controller: BatchController | None
               ) -> tuple[BatchLimits, Callable[[int], BatchLimits]]:
    """The Batcher's limits and caps provider under `controller` (as given without one)."""
    if controller is None:
        return limits, caps
    return with_controlled(limits, controller.limits), ControlledCaps(caps, controller)


def dispatch_rule(settings: Settings, targeted: DispatchRule) -> DispatchRule | None:
    """The Batcher's dispatch rule: `targeted` with a latency target, BentoML's cork with
    `batch_controller = "cork"`, else none (max_wait_ms)."""
    if settings.latency_target_ms:
        return targeted
    if settings.batch_controller == "cork":
        return CorkDispatch(CorkRule(settings.controller_target_ms or 0.0,
                                     settings.max_batch_size))
    return None
