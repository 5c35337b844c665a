"""`python -m bench.latency.sim`: the latency-target goals on the simulator, as tables."""

from __future__ import annotations

import argparse
import json

from bench.latency.sim.goals import ECHO, MINILM
from bench.latency.sim.report import details, report, table

SCENARIOS = {"echo": ECHO, "minilm": MINILM}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency.sim")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phase-s", type=float, default=60.0, help=(
        "simulated seconds per phase of each goal (10: one window a phase, the shortest)"))
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS),
                        default=list(SCENARIOS), help="the cost models to run")
    parser.add_argument("--capacity-s", type=float, default=30.0, help=(
        "simulated seconds of each probe of the capacity sweep (most of the run's time)"))
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    results = report(args.seed, args.phase_s, [SCENARIOS[s] for s in args.scenarios],
                     args.capacity_s)
    print(table(results))
    print(details(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


raise SystemExit(main())
