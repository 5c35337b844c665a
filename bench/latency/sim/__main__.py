"""`python -m bench.latency.sim`: the latency-target goals on the simulator, as tables."""

from __future__ import annotations

import argparse
import json

from bench.latency.sim.report import details, report, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency.sim")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    results = report(args.seed, args.phase_s)
    print(table(results))
    print(details(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


raise SystemExit(main())
