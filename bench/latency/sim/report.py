"""The goals G1-G5 of the latency target, for redbatch and each baseline, on the simulator:
every contender runs on the very same arrivals. Used by `python -m bench.latency.sim` and
tests/unit/bench/test_latency_sim.py (which checks redbatch's row)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.latency.sim.goals import (
    ECHO,
    MINILM,
    WINDOW_S,
    Scenario,
    best_static,
    capacity,
    contenders,
    goodput,
    percentile,
    run,
    static,
    windows,
)
from bench.latency.sim.simulate import Outcome, Phase, poisson_arrivals


def over_windows(values: Sequence[float], target_ms: float, changes: Sequence[int]) -> bool:
    """G1's rule: at most one window over per step change, right after it, by at most 20 %."""
    for index, value in enumerate(values):
        if value <= target_ms:
            continue
        excused = any(index in (change, change + 1) for change in changes)
        if not excused or value > 1.2 * target_ms:
            return False
    return sum(1 for v in values if v > target_ms) <= len(changes)


def step_load(scenario: Scenario, c: float, phase_s: float, seed: int) -> dict[str, Any]:
    """G1: 25 % -> 90 % -> 25 % of C; the percentile per window, goodput per phase."""
    phases = [Phase(phase_s, 0.25 * c), Phase(phase_s, 0.9 * c), Phase(phase_s, 0.25 * c)]
    arrivals = poisson_arrivals(phases, scenario.lengths, seed)
    bests = list(best_static(scenario, phases, seed, arrivals).values())
    changes = [int(phase_s // WINDOW_S), int(2 * phase_s // WINDOW_S)]
    rows = {}
    for name, make in contenders(scenario).items():
        outcomes = run(scenario, make(), phases, seed, arrivals)
        per_window = windows(outcomes, scenario, 3 * phase_s)
        goodputs = [goodput(outcomes, scenario.target_ms, i * phase_s, (i + 1) * phase_s)
                    for i in range(3)]
        rows[name] = {"windows_ms": [round(w, 1) for w in per_window],
                      "worst_window_ms": round(max(per_window), 1),
                      "goodput_vs_best_static": round(min(g / b if b else 1.0 for g, b in
                                                          zip(goodputs, bests, strict=True)), 3),
                      "met": over_windows(per_window, scenario.target_ms, changes)
                      and all(g >= 0.95 * b for g, b in zip(goodputs, bests, strict=True))}
    return rows


def light_load(scenario: Scenario, c: float, phase_s: float, seed: int) -> dict[str, Any]:
    """G2: at 25 % load, p50 against that of max_wait_ms = 0."""
    phases = [Phase(phase_s, 0.25 * c)]
    arrivals = poisson_arrivals(phases, scenario.lengths, seed)

    def p50(outcomes: Sequence[Outcome]) -> float:
        return statistics.median(o.latency_ms for o in outcomes if o.status == "ok")

    baseline = p50(run(scenario, static(scenario, 0.0, scenario.max_batch_size), phases, seed,
                       arrivals))
    rows = {}
    for name, make in contenders(scenario).items():
        ratio = p50(run(scenario, make(), phases, seed, arrivals)) / baseline
        rows[name] = {"p50_vs_no_wait": round(ratio, 3), "met": ratio <= 1.1}
    return rows


def overload(scenario: Scenario, c: float, phase_s: float, seed: int) -> dict[str, Any]:
    """G3: 150 % of C with shedding on: goodput, admitted within T, refusal speed."""
    phases = [Phase(phase_s, 1.5 * c)]
    arrivals = poisson_arrivals(phases, scenario.lengths, seed)
    rows = {}
    for name, make in contenders(scenario, shed=True).items():
        outcomes = run(scenario, make(), phases, seed, arrivals)
        served = [o for o in outcomes if o.status == "ok"]
        refused = [o.latency_ms for o in outcomes if o.status != "ok"]
        within = sum(1 for o in served if o.latency_ms <= scenario.target_ms) / max(1, len(served))
        slowest_refusal = max(refused, default=0.0)
        share = goodput(outcomes, scenario.target_ms, 0, phase_s) / c
        rows[name] = {"goodput_vs_c": round(share, 3), "admitted_within_t": round(within, 4),
                      "slowest_refusal_ms": round(slowest_refusal, 1),
                      "met": share >= 0.9 and within >= 0.99
                      and slowest_refusal <= 0.05 * scenario.target_ms}
    return rows


def drift_phases(c: float, phase_s: float, share: float = 0.5) -> list[Phase]:
    """G4's load: `share` of C, then the same with the service time x1.5."""
    return [Phase(phase_s, share * c), Phase(phase_s, share * c, slowdown=1.5)]


def after_recovery(per_window: Sequence[float], phase_s: float) -> list[float]:
    """The windows from the 3rd after the step on: those G4 requires under T."""
    return list(per_window[int(phase_s // WINDOW_S) + 3:])


def drift(scenario: Scenario, c: float, phase_s: float, seed: int) -> dict[str, Any]:
    """G4: the service time steps up x1.5 mid-run; back under T within 3 windows."""
    phases = drift_phases(c, phase_s)
    arrivals = poisson_arrivals(phases, scenario.lengths, seed)
    rows = {}
    for name, make in contenders(scenario).items():
        per_window = windows(run(scenario, make(), phases, seed, arrivals), scenario,
                             2 * phase_s)
        settled = all(w <= scenario.target_ms for w in after_recovery(per_window, phase_s))
        rows[name] = {"windows_ms": [round(w, 1) for w in per_window], "met": settled}
    return rows


def mixed_lengths(scenario: Scenario, c: float, phase_s: float, seed: int) -> dict[str, Any]:
    """G5: at 75 % of C with the two-peaked mix, every bucket holds the percentile."""
    phases = [Phase(phase_s, 0.75 * c)]
    arrivals = poisson_arrivals(phases, scenario.lengths, seed)
    rows = {}
    for name, make in contenders(scenario).items():
        outcomes = run(scenario, make(), phases, seed, arrivals)
        used = sorted({o.bucket for o in outcomes if o.status == "ok"})
        per_bucket = {b: percentile([o.latency_ms for o in outcomes if o.status == "ok"
                                     and o.bucket == b], scenario.percentile) for b in used}
        answered = sum(1 for o in outcomes if o.status == "ok") == len(arrivals)
        rows[name] = {"bucket_percentiles_ms": {b: round(v, 1) for b, v in per_bucket.items()},
                      "met": answered and all(v <= scenario.target_ms
                                              for v in per_bucket.values())}
    return rows


GOALS = {"G1 step load": step_load, "G2 light load": light_load, "G3 overload": overload,
         "G4 drift": drift, "G5 mixed lengths": mixed_lengths}


def report(seed: int = 1, phase_s: float = 60.0,
           scenarios: Sequence[Scenario] = (ECHO, MINILM),
           capacity_s: float = 30.0) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for scenario in scenarios:
        c = capacity(scenario, seed, capacity_s)
        results[scenario.name] = {"capacity_per_s": round(c, 1), "target_ms": scenario.target_ms,
                                  **{goal: measure(scenario, c, phase_s, seed)
                                     for goal, measure in GOALS.items()}}
    return results


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per contender, one column per goal (met or not)."""
    lines = []
    for scenario, goals in results.items():
        names = list(next(v for k, v in goals.items() if k.startswith("G")).keys())
        lines += [f"### {scenario} (C = {goals['capacity_per_s']}/s, "
                  f"T = {goals['target_ms']} ms)", "",
                  "| policy | " + " | ".join(g for g in GOALS) + " |",
                  "|---|" + "---|" * len(GOALS)]
        for name in names:
            cells = [("met" if goals[g][name]["met"] else "missed") for g in GOALS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def details(results: dict[str, Any]) -> str:
    """Markdown: each goal's figures per contender, ✗ where its bar is missed."""
    lines = []
    for scenario, goals in results.items():
        target = goals["target_ms"]
        lines += [f"#### {scenario}: C = {goals['capacity_per_s']}/s, T = {target} ms", "",
                  "| policy | G1 worst 10 s window p99 (ms) | G1 goodput / best static (worst "
                  "phase) | G2 p50 / no-wait p50 | G3 goodput / C | G3 admitted within T | G3 "
                  "slowest refusal (ms) | G4 worst window after 3 (ms) | G5 worst bucket p99 "
                  "(ms) |", "|---|" + "---:|" * 8]
        for name in goals["G1 step load"]:
            g1, g2 = goals["G1 step load"][name], goals["G2 light load"][name]
            g3, g4 = goals["G3 overload"][name], goals["G4 drift"][name]["windows_ms"]
            g5 = max(goals["G5 mixed lengths"][name]["bucket_percentiles_ms"].values(),
                     default=0.0)
            after = max(g4[len(g4) // 2 + 3:], default=0.0)

            def mark(value: float, missed: bool) -> str:
                return f"{value:g}{' ✗' if missed else ''}"

            cells = [mark(g1["worst_window_ms"], not g1["met"]),
                     mark(g1["goodput_vs_best_static"], g1["goodput_vs_best_static"] < 0.95),
                     mark(g2["p50_vs_no_wait"], not g2["met"]),
                     mark(g3["goodput_vs_c"], g3["goodput_vs_c"] < 0.9),
                     mark(g3["admitted_within_t"], g3["admitted_within_t"] < 0.99),
                     mark(g3["slowest_refusal_ms"], g3["slowest_refusal_ms"] > 0.05 * target),
                     mark(after, after > target), mark(g5, g5 > target)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
