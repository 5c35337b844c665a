"""The real-process figures of `python -m bench.latency.live --out X.json` as markdown
tables against the goals: `python -m bench.latency.live.report X.json`. Each rule of the
new goals (G2, G4, G5) reads met or missed beside its figure."""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.latency.live.goals import G2_BASELINE
from bench.latency.live.open_loop import REFUSAL_BAR
from bench.latency.sim.goals import WINDOW_S
from bench.latency.sim.report import over_windows


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


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
        rule = verdict(over_windows(row["windows_p99_ms"], target_ms, changes))
        lines.append(f"| {name} | {' / '.join(f'{w:g}' for w in row['windows_p99_ms'])} | "
                     f"{rule} | {ratio:.3f} | {row['admitted_within_t']:.4f} | "
                     f"{row.get('unanswered', 0)} |")
    if statics:
        chosen = [max(statics, key=lambda n: statics[n]["goodput_per_phase"][i])
                  for i in range(3)]
        lines += ["", "Best static in hindsight, per phase: " + "; ".join(
            f"{n} ({statics[n]['goodput_per_phase'][i]:g}/s)" for i, n in enumerate(chosen))]
    return lines


def g2_rows(goal: dict[str, Any]) -> list[str]:
    """G2: p50 against that of `static wait 0 batch 32` in this run; bar 1.1 x."""
    base = goal.get(G2_BASELINE, {}).get("p50_ms")
    lines = ["| configuration | p50 (ms) | p50 / no-wait p50 | rule (<= 1.1) | p99 (ms) | "
             "unanswered |", "|---|---:|---:|---|---:|---:|"]
    for name, row in goal.items():
        p50 = row.get("p50_ms")
        ratio = p50 / base if base and p50 is not None else None
        cells = ("n/a", "n/a") if ratio is None else (f"{ratio:.3f}", verdict(ratio <= 1.1))
        lines.append(f"| {name} | {p50} | {cells[0]} | {cells[1]} | {row['p99_ms']:g} | "
                     f"{row.get('unanswered', 0)} |")
    return lines


def g3_rows(goal: dict[str, Any], c: float, target_ms: float) -> list[str]:
    """G3: goodput against C, admitted within T, how fast refusals were answered."""
    lines = ["| configuration | goodput / C | admitted within T | refused | refusal p99 / max "
             f"(ms) | refused within {REFUSAL_BAR * target_ms:g} ms | unanswered |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in goal.items():
        share = row["goodput_per_phase"][0] / c
        within = row.get("refused_within_bar")
        lines.append(f"| {name} | {share:.3f} | {row['admitted_within_t']:.4f} | "
                     f"{row['refused']} | {row['refusal_p99_ms']:g} / "
                     f"{row.get('refusal_max_ms', 0.0):g} | "
                     f"{'n/a' if within is None else f'{within:.2%}'} | "
                     f"{row.get('unanswered', 0)} |")
    return lines


def g4_settled(windows: list[float], change: int, target_ms: float,
               unanswered: int = 0) -> bool:
    """G4's rule: every window from the 3rd after the step on is back under T (and there
    is one to check). A request never answered is over T, though no window shows it (a
    window of unanswered requests reads 0)."""
    after = windows[change + 3:]
    return bool(after) and all(w <= target_ms for w in after) and unanswered == 0


def g4_rows(goal: dict[str, Any], drift_at_s: float, target_ms: float) -> list[str]:
    """G4: the windows around the device's step up; back under T within 3 windows."""
    change = int(drift_at_s // WINDOW_S)
    lines = [f"Step at window {change} ({drift_at_s:g} s); the rule checks windows "
             f"{change + 3} on.", "",
             "| configuration | 10 s windows p99 (ms) | windows over T after the step | "
             "worst window from the 3rd on (ms) | rule | median batch compute per phase "
             "(ms) | unanswered |", "|---|---|---:|---:|---|---|---:|"]
    for name, row in goal.items():
        windows, unanswered = row["windows_p99_ms"], row.get("unanswered", 0)
        over = sum(1 for w in windows[change:] if w > target_ms)
        worst = max(windows[change + 3:], default=0.0)
        lines.append(f"| {name} | {' / '.join(f'{w:g}' for w in windows)} | {over} | "
                     f"{worst:g} | "
                     f"{verdict(g4_settled(windows, change, target_ms, unanswered))} | "
                     f"{' / '.join(str(v) for v in row.get('compute_ms_per_phase', []))} | "
                     f"{unanswered} |")
    return lines


def g5_met(buckets: dict[str, Any], target_ms: float) -> tuple[bool, bool]:
    """G5's two rules: every bucket's p99 <= T; none starves (each served all it was sent)."""
    held = all(b["p99_ms"] <= target_ms for b in buckets.values())
    fed = all(b["served"] == b["sent"] for b in buckets.values())
    return held, fed


def g5_rows(goal: dict[str, Any], target_ms: float) -> list[str]:
    """G5: per length bucket, the p99 and how many were served of those sent."""
    lines = ["| configuration | p99 per bucket (ms) | served / sent per bucket | every bucket "
             "p99 <= T | none starves | overall p99 (ms) |", "|---|---|---|---|---|---:|"]
    for name, row in goal.items():
        buckets = row["buckets"]
        held, fed = g5_met(buckets, target_ms)
        p99s = " / ".join(f"b{b}: {v['p99_ms']:g}" for b, v in buckets.items())
        counts = " / ".join(f"b{b}: {v['served']}/{v['sent']}" for b, v in buckets.items())
        lines.append(f"| {name} | {p99s} | {counts} | {verdict(held)} | {verdict(fed)} | "
                     f"{row['p99_ms']:g} |")
    return lines


def described(results: dict[str, Any], goal: str) -> dict[str, Any]:
    return results.get("goal_settings", {}).get(goal, {})


def new_goals(results: dict[str, Any], target: float) -> list[str]:
    """G2, G4 and G5, each with the load it ran."""
    out: list[str] = []
    if "G2 light load" in results:
        out += [f"G2 light load (25 % of C; against `{G2_BASELINE}`):", "",
                *g2_rows(results["G2 light load"]), ""]
    if "G4 drift" in results:
        drift = described(results, "G4 drift")
        device = ("MiniLM's batch times" if results.get("model") == "minilm"
                  else "the echo model's cost")
        out += [f"G4 drift (50 % of C; {device} x{drift.get('drift_factor')} "
                f"from {drift.get('drift_at_s')} s of arrivals on):", "",
                *g4_rows(results["G4 drift"], drift.get("drift_at_s") or 0.0, target), ""]
    if "G5 mixed lengths" in results:
        g5 = described(results, "G5 mixed lengths")
        unit = "tokens" if results.get("model") == "minilm" else "B"
        out += [f"G5 mixed lengths (two-peaked lengths, 70 % 8-16 {unit} in bucket 0, 30 % "
                f"96-128 {unit} in bucket 1; model options {g5.get('model_options')}; phases "
                f"[s, /s] {g5.get('phases')}):", "",
                *g5_rows(results["G5 mixed lengths"], target), ""]
    return out


def goal_rows(results: dict[str, Any], goal: str, rows: dict[str, Any],
              target: float) -> list[str]:
    """The table of one of G2, G4, G5 for these rows (none for another goal)."""
    if goal == "G2 light load":
        return g2_rows(rows)
    if goal == "G4 drift":
        return g4_rows(rows, described(results, goal).get("drift_at_s") or 0.0, target)
    return g5_rows(rows, target) if goal == "G5 mixed lengths" else []


def repeats(results: dict[str, Any], target: float) -> list[str]:
    """Configurations run once more (`reruns` in the JSON), beside, not instead of, the first."""
    out: list[str] = []
    for goal, rows in results.get("reruns", {}).items():
        out += [f"{goal}, run once more:", "", *goal_rows(results, goal, rows, target), ""]
    return out


def round_rows(results: dict[str, Any]) -> list[str]:
    """With `--rounds N`: each configuration's p50 and p99 in every round and their median,
    and its p50 against the no-wait static's of the same round; G2's bar is read on the
    median of that (the rounds ran in turn, so a slower spell of the machine falls on both)."""
    out: list[str] = []
    for goal, later in results.get("later_rounds", {}).items():
        rounds = [results[goal], *later]
        out += [f"{goal}, {len(rounds)} rounds in turn (each configuration once per round):",
                "", "| configuration | p50 per round (ms) | p99 per round (ms) | median p50 / "
                "p99 (ms) | p50 / no-wait p50 per round | median ratio |",
                "|---|---|---|---|---|---|"]
        out += [round_line(goal, name, [r for r in rounds if name in r]) for name in rounds[0]]
        out.append("")
    return out


def round_line(goal: str, name: str, rounds: list[dict[str, Any]]) -> str:
    """One configuration's row of `round_rows`."""
    p50 = [r[name]["p50_ms"] for r in rounds]
    p99 = [r[name]["p99_ms"] for r in rounds]
    ratios = [r[name]["p50_ms"] / r[G2_BASELINE]["p50_ms"] for r in rounds
              if r.get(G2_BASELINE, {}).get("p50_ms")]
    ratio = "n/a"
    if ratios:
        middle = statistics.median(ratios)
        ratio = f"{middle:.3f}" + (f", {verdict(middle <= 1.1)}" if goal == "G2 light load"
                                   else "")
    return (f"| {name} | {' / '.join(f'{v:g}' for v in p50)} | "
            f"{' / '.join(f'{v:g}' for v in p99)} | "
            f"{statistics.median(p50):g} / {statistics.median(p99):g} | "
            f"{' / '.join(f'{v:.3f}' for v in ratios) or 'n/a'} | {ratio} |")


def joined(windows: list[dict[str, Any]], key: str) -> str:
    return " / ".join(f"{window[key]:g}" for window in windows)


def dispatch_rows(results: dict[str, Any]) -> list[str]:
    """The worker's decisions per 10 s window, for the runs of `--sample-metrics`."""
    out: list[str] = []
    for goal, rows in results.items():
        sampled = {name: row["dispatch"] for name, row in rows.items()
                   if isinstance(row, dict) and "dispatch" in row} \
            if goal.startswith("G") and isinstance(rows, dict) else {}
        if not sampled:
            continue
        out += [f"{goal}, the worker's decisions per 10 s window (`--sample-metrics`):", "",
                "| configuration | requests per batch | device busy | margin (ms) | "
                "dispatch reasons (whole run) |", "|---|---|---|---|---|"]
        for name, windows in sampled.items():
            reasons: Counter[str] = Counter()
            for window in windows:
                reasons.update(window["reasons"])
            out.append(f"| {name} | {joined(windows, 'per_batch')} | "
                       f"{joined(windows, 'busy')} | {joined(windows, 'margin_ms')} | "
                       f"{', '.join(f'{r} {n}' for r, n in reasons.most_common())} |")
        out.append("")
    return out


def render(results: dict[str, Any]) -> str:
    target, c = results["target_ms"], results["capacity_per_s"]
    out = [f"Model {results.get('model', 'echo')}: C = {c}/s, T = {target:g} ms, "
           f"{results['phase_s']:g} s phases; load average "
           f"at start {results.get('load_average_at_start')}, at end "
           f"{results.get('load_average_at_end')}", ""]
    if "G1 step load" in results:
        out += ["G1 step load (25 % -> 90 % -> 25 % of C):", "",
                *g1_rows(results["G1 step load"], target), ""]
    if "G3 overload" in results:
        out += ["G3 overload (150 % of C, shed_over_target for redbatch; the static "
                "settings and baselines 2-4 cannot shed, cork refuses at dispatch):", "",
                *g3_rows(results["G3 overload"], c, target), ""]
    return "\n".join(out + new_goals(results, target) + repeats(results, target)
                     + round_rows(results) + dispatch_rows(results))


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())))
