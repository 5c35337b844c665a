"""The peers report: each system's median texts/s, redbatch's ratio to it, and the goals."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common.stats import median
from bench.peers.systems import Skipped, System

PEER_GOAL = 1.5  # default redbatch over every peer at that peer's best configuration
OFFLINE_GOAL = 0.9  # default redbatch over its own offline limit, same dtype
# the bound redbatch's own dtypes are held to (issue 45): a peer's faster configuration
# below it (ONNX Runtime's dynamic int8: 0.93) is also compared at its best above it
ACCURACY_BOUND = 0.999


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the rounds' ratios: each round's figures were taken side by side."""
    return median([a / b for a, b in zip(ours, theirs, strict=True)])


def system_rows(systems: list[System]) -> list[dict[str, Any]]:
    redbatch = systems[0].rates  # the default worker, always first
    return [{"name": s.name, "peer": s.peer, "dtype": s.dtype, "note": s.note,
             "config": s.chosen, "selection_texts_per_s": s.selection, "rates": s.rates,
             "texts_per_s": median(s.rates), "min_cosine": s.min_cosine,
             "redbatch_over": paired_ratio(redbatch, s.rates)}
            for s in systems]


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """redbatch >= 1.5x each peer's fastest system, and >= 0.9x its own offline limit."""
    found = []
    for peer in dict.fromkeys(r["peer"] for r in rows if r["peer"] != "redbatch"):
        theirs = [r for r in rows if r["peer"] == peer]
        best = max(theirs, key=lambda r: r["texts_per_s"])
        found.append(peer_goal(peer, best, "at its best"))
        accurate = [r for r in theirs if (r["min_cosine"] or 0) >= ACCURACY_BOUND]
        if accurate and (best["min_cosine"] or 0) < ACCURACY_BOUND:
            found.append(peer_goal(peer, max(accurate, key=lambda r: r["texts_per_s"]),
                                   f"at its best with min cosine >= {ACCURACY_BOUND}"))
    offline = next(r for r in rows if r["name"] == "redbatch offline")
    found.append({"goal": f"redbatch >= {OFFLINE_GOAL}x its offline limit ({offline['dtype']}, "
                          f"{offline['config']})",
                  "value": offline["redbatch_over"], "bar": OFFLINE_GOAL,
                  "met": offline["redbatch_over"] >= OFFLINE_GOAL,
                  "same_dtype": offline["dtype"] == rows[0]["dtype"]})
    return found


def peer_goal(peer: str, row: dict[str, Any], which: str) -> dict[str, Any]:
    return {"goal": f"redbatch >= {PEER_GOAL}x {peer} {which} ({row['name']}, "
                    f"{row['config']})",
            "value": row["redbatch_over"], "bar": PEER_GOAL,
            "met": row["redbatch_over"] >= PEER_GOAL}


def summarise(systems: list[System], skipped: list[Skipped]) -> dict[str, Any]:
    rows = system_rows(systems)
    return {"systems": rows, "skipped": [asdict(s) for s in skipped], "goals": goals(rows)}


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"# redbatch against its peers on {machine['cpu']} ({machine['cpus']} cores)", "",
             f"CPU flags: {', '.join(machine['cpu_flags']) or 'none of interest'}; torch "
             f"{machine['torch']}; {report['texts']} texts ({report['corpus']}), "
             f"{report['repeats']} rounds side by side; load average {machine['load_average']} "
             f"at the start, {report['load_average_end']} at the end; `{report['command']}`", "",
             "| system | dtype | best configuration | texts/s (median) | redbatch / it | "
             f"min cosine to {report['accuracy_reference'] or '-'} |",
             "|---|---|---|---:|---:|---:|"]
    for row in report["systems"]:
        cosine = "" if row["min_cosine"] is None else f"{row['min_cosine']:.5f}"
        lines.append(f"| {row['name']} | {row['dtype']} | {row['config']} | "
                     f"{row['texts_per_s']:.1f} | {row['redbatch_over']:.2f}x | {cosine} |")
    for skip in report["skipped"]:
        lines.append(f"| {skip['name']} | | {skip['reason']} | | | |")
    lines += ["", "Goals:", ""]
    lines += [f"- {'MET' if g['met'] else 'MISSED'}: {g['goal']}: {g['value']:.2f}x"
              for g in report["goals"]]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], stem: Path) -> tuple[Path, Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    data, table = stem.with_suffix(".json"), stem.with_suffix(".md")
    data.write_text(json.dumps(report, indent=2) + "\n")
    table.write_text(markdown(report))
    return data, table
