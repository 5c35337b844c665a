"""G4 (drift) on the simulator, over many seeds, on a device of your choosing: does any
policy hold it, and is redbatch level with the best of them?

`python -m bench.latency.sim` runs G4 on one seed of its two scenarios, whose devices
have two instances and a small fixed cost. On this machine the real MiniLM runs on one
instance, and at 50 % of C a x1.5 drift leaves it 0.85-0.9 busy (the benchmark's
`--sample-metrics`). This runs the same goal on such a device, e.g.

    python -m bench.latency.sim.drift --fixed-ms 12 --per-token-ms 0.2 --instances 1 --seeds 8

and reports, for redbatch, every adaptive baseline and the no-wait and short-wait statics,
on the very same arrivals per seed: in how many seeds the goal is met, the median worst
window from the 3rd after the step on, and the windows over T in all.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from bench.latency.live.run import positive_int
from bench.latency.sim.goals import (
    WINDOW_S,
    Scenario,
    capacity,
    contenders,
    run,
    static,
    two_peaks,
    windows,
)
from bench.latency.sim.report import after_recovery, drift_phases
from bench.latency.sim.simulate import ServiceCost

STATICS = ((0.0, 32), (2.0, 32), (5.0, 32))


def scenario(fixed_ms: float, per_token_ms: float, instances: int,
             target_ms: float) -> Scenario:
    """MiniLM's two-peaked lengths and boundaries on the given device."""
    return Scenario(f"{fixed_ms:g} ms + {per_token_ms:g} ms per padded token, "
                    f"{instances} instance(s)", ServiceCost(fixed_ms, per_token_ms, 0.15),
                    two_peaks, [16, 32, 64, 128], target_ms, instances=instances)


def policies(s: Scenario) -> dict[str, Callable[[], object]]:
    chosen = dict(contenders(s))
    for wait, size in STATICS:
        chosen[f"static wait {wait:g} batch {size}"] = partial(static, s, wait, size)
    return chosen


def worst_after_step(s: Scenario, make: Callable[[], object], share: float, c: float,
                     phase_s: float, seed: int) -> list[float]:
    """The windows from the 3rd after the step on (those G4 requires under T)."""
    per_window = windows(run(s, make(), drift_phases(c, phase_s, share), seed), s, 2 * phase_s)
    return after_recovery(per_window, phase_s)


def sweep(s: Scenario, share: float, seeds: Sequence[int], phase_s: float) -> dict[str, Any]:
    if phase_s < 4 * WINDOW_S:
        raise ValueError(f"a phase of {phase_s:g} s leaves no window from the 3rd after the "
                         f"step: G4 needs phases of at least {4 * WINDOW_S:g} s")
    c = capacity(s, seeds[0])
    rows: dict[str, Any] = {}
    for name, make in policies(s).items():
        after = [worst_after_step(s, make, share, c, phase_s, seed) for seed in seeds]
        rows[name] = {"met": sum(max(w) <= s.target_ms for w in after),
                      "median_worst_ms": round(statistics.median(max(w) for w in after), 1),
                      "windows_over": sum(v > s.target_ms for w in after for v in w)}
    return {"capacity_per_s": round(c, 1), "rows": rows}


def table(s: Scenario, share: float, seeds: Sequence[int], result: dict[str, Any]) -> str:
    lines = [f"G4 at {share:.0%} of C = {result['capacity_per_s']}/s, T = {s.target_ms:g} ms, "
             f"{s.name}, seeds {seeds[0]}-{seeds[-1]}", "",
             "| policy | seeds met | median worst window from the 3rd (ms) | windows over T |",
             "|---|---:|---:|---:|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['met']} of {len(seeds)} | {row['median_worst_ms']:g} | "
                     f"{row['windows_over']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency.sim.drift")
    parser.add_argument("--fixed-ms", type=float, default=12.0)
    parser.add_argument("--per-token-ms", type=float, default=0.2)
    parser.add_argument("--instances", type=positive_int, default=1)
    parser.add_argument("--target-ms", type=float, default=250.0)
    parser.add_argument("--share", type=float, default=0.5, help="the load, of C")
    parser.add_argument("--seeds", type=positive_int, default=8)
    parser.add_argument("--phase-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    s = scenario(args.fixed_ms, args.per_token_ms, args.instances, args.target_ms)
    seeds = list(range(1, args.seeds + 1))
    try:  # a phase too short to leave a window from the 3rd after the step
        result = sweep(s, args.share, seeds, args.phase_s)
    except ValueError as exc:
        parser.error(f"--phase-s: {exc}")
    print(table(s, args.share, seeds, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
