"""The latency-target goals (G1-G5), measured on the simulator for redbatch and every
baseline on the same arrivals: `python -m bench.latency.sim` prints the table.

C, the capacity, is the highest rate at which some static setting still holds the
percentile under the target, found by a sweep. Goodput counts answers within the target.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.latency.sim.baselines import (
    AimdDispatcher,
    CorkDispatcher,
    DynamicTimeoutDispatcher,
    StaticDispatcher,
    StepDispatcher,
    TargetDispatcher,
)
from bench.latency.sim.simulate import (
    Arrival,
    Outcome,
    Phase,
    ServiceCost,
    Simulation,
    poisson_arrivals,
)

STATIC_SWEEP = [(wait, size) for wait in (0.0, 2.0, 5.0, 10.0, 20.0, 50.0)
                for size in (4, 8, 16, 32)]
WINDOW_S = 10.0


@dataclass(frozen=True)
class Scenario:
    """A device, a length mix and a target: what a run of the simulator is about."""

    name: str
    cost: ServiceCost
    lengths: Callable[[random.Random], int]
    boundaries: Sequence[int]
    target_ms: float
    max_batch_size: int = 32
    instances: int = 1
    percentile: float = 0.99


def echo_like(rng: random.Random) -> int:
    return 1


def two_peaks(rng: random.Random) -> int:
    """Short and long inputs, as a search engine's queries and documents."""
    return rng.randint(8, 16) if rng.random() < 0.7 else rng.randint(96, 128)


ECHO = Scenario("echo cost model (10 ms + 1 ms per request)", ServiceCost(10.0, 1.0, 0.05),
                echo_like, [], target_ms=100.0, instances=2)
MINILM = Scenario("MiniLM cost model (10 ms + 0.21 ms per padded token), two-peaked lengths",
                  ServiceCost(10.0, 0.21, 0.08), two_peaks, [16, 32, 64, 128], target_ms=250.0,
                  instances=2)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(scenario: Scenario, dispatcher: object, phases: Sequence[Phase], seed: int,
        arrivals: Sequence[Arrival] | None = None) -> list[Outcome]:
    arrivals = arrivals if arrivals is not None else poisson_arrivals(
        phases, scenario.lengths, seed)
    simulation = Simulation(dispatcher, scenario.cost, phases,  # type: ignore[arg-type]
                            scenario.instances, seed)
    return simulation.run(arrivals)


def windows(outcomes: Sequence[Outcome], scenario: Scenario, total_s: float,
            bucket: int | None = None) -> list[float]:
    """The percentile of served latencies per WINDOW_S of arrivals."""
    count = math.ceil(total_s / WINDOW_S)
    grouped: list[list[float]] = [[] for _ in range(count)]
    for o in outcomes:
        if o.status == "ok" and (bucket is None or o.bucket == bucket):
            grouped[min(count - 1, int(o.arrived_ms / 1000 // WINDOW_S))].append(o.latency_ms)
    return [percentile(g, scenario.percentile) for g in grouped]


def goodput(outcomes: Sequence[Outcome], target_ms: float, start_s: float,
            end_s: float) -> float:
    """Answers within the target per second, for arrivals in [start, end)."""
    good = sum(1 for o in outcomes if o.status == "ok" and o.latency_ms <= target_ms
               and start_s * 1000 <= o.arrived_ms < end_s * 1000)
    return good / (end_s - start_s)


def holds(scenario: Scenario, dispatcher: object, rate: float, seed: int,
          seconds: float = 30.0) -> bool:
    outcomes = run(scenario, dispatcher, [Phase(seconds, rate)], seed)
    served = [o.latency_ms for o in outcomes if o.status == "ok"]
    return len(served) == len(outcomes) and \
        percentile(served, scenario.percentile) <= scenario.target_ms


def static(scenario: Scenario, wait: float, size: int) -> StaticDispatcher:
    return StaticDispatcher(scenario.boundaries, wait, size)


def capacity(scenario: Scenario, seed: int = 1, seconds: float = 30.0) -> float:
    """The highest rate some static setting holds (bisection per setting, 2 % steps), each
    probe `seconds` of simulated traffic."""
    top = scenario.max_batch_size / scenario.cost.sample(
        scenario.max_batch_size, max(scenario.lengths(random.Random(seed)) for _ in range(50)),
        1.0, random.Random(0)) * 1000 * scenario.instances * 2
    best = 0.0
    for wait, size in STATIC_SWEEP:
        if size > scenario.max_batch_size:
            continue
        low, high = best, top
        if not holds(scenario, static(scenario, wait, size), max(low, 1.0), seed, seconds):
            continue
        while high - low > 0.02 * high:
            middle = (low + high) / 2
            low, high = (middle, high) if holds(scenario, static(scenario, wait, size),
                                                middle, seed, seconds) else (low, middle)
        best = max(best, low)
    return best


def contenders(scenario: Scenario, shed: bool = False) -> dict[str, Callable[[], object]]:
    """redbatch and the adaptive baselines, fresh for each run."""
    s = scenario
    return {
        "redbatch": lambda: TargetDispatcher(s.boundaries, s.target_ms, s.max_batch_size,
                                             s.percentile, s.instances, shed),
        "aimd": lambda: AimdDispatcher(s.boundaries, s.target_ms, s.max_batch_size),
        "step": lambda: StepDispatcher(s.boundaries, s.target_ms, s.max_batch_size),
        "dynamic_timeout": lambda: DynamicTimeoutDispatcher(s.boundaries, s.max_batch_size),
        "bentoml_cork": lambda: CorkDispatcher(s.target_ms, s.max_batch_size),
    }


def best_static(scenario: Scenario, phases: Sequence[Phase], seed: int,
                arrivals: Sequence[Arrival]) -> dict[str, float]:
    """Per phase, the static setting with the highest goodput (chosen in hindsight)."""
    bests: dict[str, float] = {}
    start = 0.0
    runs = {(w, n): run(scenario, static(scenario, w, n), phases, seed, arrivals)
            for w, n in STATIC_SWEEP if n <= scenario.max_batch_size}
    for number, phase in enumerate(phases):
        end = start + phase.seconds
        bests[f"phase {number}"] = max(goodput(o, scenario.target_ms, start, end)
                                       for o in runs.values())
        start = end
    return bests


def summary(outcomes: Sequence[Outcome], scenario: Scenario, phases: Sequence[Phase],
            bucket_count: int = 1) -> dict[str, object]:
    total = sum(p.seconds for p in phases)
    served = [o.latency_ms for o in outcomes if o.status == "ok"]
    start, goodputs = 0.0, []
    for phase in phases:
        goodputs.append(goodput(outcomes, scenario.target_ms, start, start + phase.seconds))
        start += phase.seconds
    return {
        "windows_ms": [round(w, 1) for w in windows(outcomes, scenario, total)],
        "p50_ms": round(statistics.median(served), 1) if served else None,
        "percentile_ms": round(percentile(served, scenario.percentile), 1),
        "goodput_per_phase": [round(g, 1) for g in goodputs],
        "refused": sum(1 for o in outcomes if o.status != "ok"),
        "buckets_ms": [round(percentile([o.latency_ms for o in outcomes if o.status == "ok"
                                         and o.bucket == b], scenario.percentile), 1)
                       for b in range(bucket_count)],
    }
