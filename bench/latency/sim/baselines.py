"""Batching policies for the simulator (bench/latency/sim/simulate.py), all on the same arrivals:
redbatch's latency target, static settings, and the known adaptive schemes.

1. static (max_wait_ms, max_batch_size), the best chosen in hindsight from a sweep;
2. AIMD on the batch size, Clipper-style: +step while the p99 batch latency is under the
   target, x0.9 when over;
3. a step controller: batch cap ±2 on the windowed p99 against 1.2 × and 0.7 × target;
4. the dynamic timeout wait = max(10 ms, 2 × the average latency);
5. BentoML's CorkDispatcher rule: latency = a·n + b fitted over recent batches; wait while
   n·(age of the newest + a) ≤ 0.95 × the mean wait; refuse when age of the oldest + a·n + b
   ≥ the target.

2-4 are worker/policy/controllers.py and 5 is worker/policy/cork.py, which the worker also
runs (`batch_controller`), so the simulator and the real-process benchmark
(bench/latency/live/run.py) test one code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from bench.latency.sim.simulate import EPOCH_MS
from worker.policy.batching import Batch, Batcher, BatchLimits, Pending
from worker.policy.controllers import (
    AimdController,
    BatchController,
    DynamicTimeout,
    StepController,
    with_controlled,
)
from worker.policy.cork import HISTORY, TICK_MS, CorkRule
from worker.policy.latency import LatencyPolicy
from worker.policy.targeted import TargetedDispatch

MAX_TOKENS = 1 << 30  # the simulated device has no token cap


def unix_ms(now_ms: float) -> int:
    return int(EPOCH_MS + now_ms)


class StaticDispatcher:
    """Today's batching: full, or the oldest has waited max_wait_ms."""

    name = "static"

    def __init__(self, boundaries: Sequence[int], max_wait_ms: float, max_batch_size: int) -> None:
        self.batcher = Batcher(boundaries, BatchLimits(max_batch_size, MAX_TOKENS,
                                                       max_wait_ms / 1000))
        self.label = f"static wait {max_wait_ms:g} ms, batch {max_batch_size}"

    def add(self, pending: Pending, now_ms: float) -> str | None:
        self.batcher.add(pending)
        return None

    def next_batch(self, now_ms: float, instance: int, busy: bool) -> Batch | None:
        return self.batcher.next_batch(now_ms / 1000, unix_ms(now_ms))

    def wake_in_ms(self, now_ms: float) -> float | None:
        wait = self.batcher.seconds_until_ready(now_ms / 1000, unix_ms(now_ms))
        return None if wait is None else wait * 1000

    def started(self, instance: int, batch: Batch, now_ms: float) -> None:
        pass

    def finished(self, instance: int, batch: Batch, service_ms: float, now_ms: float,
                 latencies_ms: list[float]) -> None:
        pass

    def set_limits(self, **changes: float) -> None:
        self.batcher.limits = replace(self.batcher.limits, **changes)  # type: ignore[arg-type]


class TargetDispatcher(StaticDispatcher):
    """redbatch with `latency_target_ms`: the worker's own policy objects."""

    name = "redbatch"

    def __init__(self, boundaries: Sequence[int], target_ms: float, max_batch_size: int,
                 percentile: float = 0.99, instances: int = 1, shed: bool = False) -> None:
        super().__init__(boundaries, 0.0, max_batch_size)
        self.policy = LatencyPolicy(target_ms, percentile, len(boundaries) + 1, instances, shed)
        self.targeted = TargetedDispatch(self.policy)
        self.batcher.targeted = self.targeted
        self.label = f"redbatch target {target_ms:g} ms"

    def add(self, pending: Pending, now_ms: float) -> str | None:
        if self.targeted.checks(pending):
            admission = self.targeted.admit(self.batcher, pending, unix_ms(now_ms))
            if not admission.admit:
                return admission.code
        self.batcher.add(pending)
        return None

    def started(self, instance: int, batch: Batch, now_ms: float) -> None:
        self.policy.started(instance, batch.bucket, len(batch.members), batch.longest,
                            unix_ms(now_ms))

    def finished(self, instance: int, batch: Batch, service_ms: float, now_ms: float,
                 latencies_ms: list[float]) -> None:
        self.policy.finished(instance, batch.bucket, len(batch.members), batch.longest,
                             service_ms, unix_ms(now_ms))
        self.policy.answered(unix_ms(now_ms), latencies_ms)


class ControlledDispatcher(StaticDispatcher):
    """A baseline that moves the batch cap or the wait after each batch: the controllers of
    worker/policy/controllers.py, the same objects the worker runs by `batch_controller`."""

    def __init__(self, boundaries: Sequence[int], controller: BatchController,
                 label: str) -> None:
        super().__init__(boundaries, 0.0, 1)
        self.controller, self.label = controller, label
        self.batcher.limits = with_controlled(self.batcher.limits, controller.limits)

    def finished(self, instance: int, batch: Batch, service_ms: float, now_ms: float,
                 latencies_ms: list[float]) -> None:
        controlled = self.controller.observe(service_ms, latencies_ms)
        self.batcher.limits = with_controlled(self.batcher.limits, controlled)


class AimdDispatcher(ControlledDispatcher):
    """Clipper: additive increase of the batch cap while batches are fast, x0.9 when not."""

    name = "aimd"

    def __init__(self, boundaries: Sequence[int], target_ms: float, max_batch_size: int,
                 step: int = 2) -> None:
        super().__init__(boundaries, AimdController(target_ms, max_batch_size, 0.0, step),
                         "AIMD batch size (Clipper)")


class StepDispatcher(ControlledDispatcher):
    """Batch cap ±2 on the windowed p99 of end-to-end latency against 1.2 T and 0.7 T."""

    name = "step"

    def __init__(self, boundaries: Sequence[int], target_ms: float, max_batch_size: int) -> None:
        super().__init__(boundaries, StepController(target_ms, max_batch_size, 0.0),
                         "step controller (±2)")


class DynamicTimeoutDispatcher(ControlledDispatcher):
    """wait = max(10 ms, 2 × the average end-to-end latency)."""

    name = "dynamic_timeout"

    def __init__(self, boundaries: Sequence[int], max_batch_size: int) -> None:
        super().__init__(boundaries, DynamicTimeout(max_batch_size),
                         "dynamic timeout max(10 ms, 2 x mean)")


class CorkDispatcher(StaticDispatcher):
    """BentoML's CorkDispatcher on one FIFO queue (it has no length buckets): the worker's
    own rule (worker/policy/cork.py, `batch_controller = "cork"`), on the simulated clock.
    Its refusals are counted with the expired (the simulator's `deadline_exceeded`)."""

    name = "bentoml_cork"

    def __init__(self, target_ms: float, max_batch_size: int, history: int = HISTORY) -> None:
        super().__init__([], 0.0, max_batch_size)
        self.rule = CorkRule(target_ms, max_batch_size, history)
        self.arrivals: deque[float] = deque()  # the queue's arrival times, the oldest first
        self.queue: deque[Pending] = deque()
        self.label = "BentoML CorkDispatcher"

    def add(self, pending: Pending, now_ms: float) -> str | None:
        self.arrivals.append(now_ms)
        self.queue.append(pending)
        return None

    def next_batch(self, now_ms: float, instance: int, busy: bool) -> Batch | None:
        decision = self.rule.decide(now_ms, self.arrivals)
        refused = [self._pop() for _ in range(decision.refuse)]
        members = [self._pop() for _ in range(decision.take)]
        if not members and not refused:
            return None
        return Batch(0, members, expired=refused)

    def _pop(self) -> Pending:
        self.arrivals.popleft()
        return self.queue.popleft()

    def wake_in_ms(self, now_ms: float) -> float | None:
        return TICK_MS if self.queue else None  # BentoML polls on a short tick

    def finished(self, instance: int, batch: Batch, service_ms: float, now_ms: float,
                 latencies_ms: list[float]) -> None:
        self.rule.finished(len(batch.members), service_ms)
