"""The real-process figures of `python -m bench.latency_bench --out X.json` as markdown
tables against the goals: `python -m bench.latency_bench_report X.json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.latency_report import over_windows


def g1_rows(goal: dict[str, Any], target_ms: float) -> list[str]:
    """G1: every window's p99 (from the XADD time), the window rule, goodput per phase
    against the best static setting of this run for that phase (chosen in hindsight); then
    which static that was, phase by phase."""
    statics = {name: row for name, row in goal.items() if name.startswith("static")}
    best = [max(row["goodput_per_phase"][i] for row in statics.values()) if statics else 0.0
            for i in range(3)]
    windows = len(next(iter(goal.values()))["windows_p99_ms"])
    changes = [windows // 3, 2 * windows // 3]
    lines = ["| configuration | 10 s windows p99 (ms) | window rule | goodput / best static "
             "(worst phase) | admitted within T | unanswered |", "|---|---|---|---:|---:|---:|"]
    for name, row in goal.items():
        ratio = min((g / b if b else 1.0) for g, b in zip(row["goodput_per_phase"], best,
                                                          strict=True))
        rule = "met" if over_windows(row["windows_p99_ms"], target_ms, changes) else "missed"
        lines.append(f"| {name} | {' / '.join(f'{w:g}' for w in row['windows_p99_ms'])} | "
                     f"{rule} | {ratio:.3f} | {row['admitted_within_t']:.4f} | "
                     f"{row.get('unanswered', 0)} |")
    if statics:
        chosen = [max(statics, key=lambda n: statics[n]["goodput_per_phase"][i])
                  for i in range(3)]
        lines += ["", "Best static in hindsight, per phase: " + "; ".join(
            f"{n} ({statics[n]['goodput_per_phase'][i]:g}/s)" for i, n in enumerate(chosen))]
    return lines


def g3_rows(goal: dict[str, Any], c: float, target_ms: float) -> list[str]:
    """G3: goodput against C, admitted within T, how fast refusals were answered."""
    lines = ["| configuration | goodput / C | admitted within T | refused | refusal p99 / max "
             "(ms) | unanswered |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in goal.items():
        share = row["goodput_per_phase"][0] / c
        lines.append(f"| {name} | {share:.3f} | {row['admitted_within_t']:.4f} | "
                     f"{row['refused']} | {row['refusal_p99_ms']:g} / "
                     f"{row.get('refusal_max_ms', 0.0):g} | {row.get('unanswered', 0)} |")
    return lines


def render(results: dict[str, Any]) -> str:
    target, c = results["target_ms"], results["capacity_per_s"]
    out = [f"C = {c}/s, T = {target:g} ms, {results['phase_s']:g} s phases; load average "
           f"at start {results.get('load_average_at_start')}", ""]
    if "G1 step load" in results:
        out += ["G1 step load (25 % -> 90 % -> 25 % of C):", "",
                *g1_rows(results["G1 step load"], target), ""]
    if "G3 overload" in results:
        out += ["G3 overload (150 % of C, shed_over_target for redbatch; the static "
                "settings and the adaptive baselines cannot shed):", "",
                *g3_rows(results["G3 overload"], c, target), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
