"""The latency target on real processes: `python -m bench.latency_bench`.

Worker processes on an embedded Redis serve the echo cost model (10 ms per batch + 1 ms
per request, two instances), and an open-loop producer sends the same seeded Poisson
arrivals to each configuration in turn: redbatch with `latency_target_ms`, and static
settings swept over max_wait_ms and max_batch_size (baseline 1). G1 is the step load
25 % -> 90 % -> 25 % of C; G3 is 150 % of C, with `shed_over_target` for redbatch.
C is measured as the issue defines it, coarsely: the highest of 60-95 % of the saturated
rate at which a static setting (wait 0 or 5 ms, batch 32) still holds p99 <= T over 10 s.

The adaptive baselines 2-5 exist only in the simulator (bench/baselines.py, reported by
`python -m bench.latency_goals`): they are not worker settings.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import redis

from bench.cluster import Workers
from bench.latency_goals import WINDOW_S, percentile
from bench.load import Timed, drain, open_loop_at
from bench.simulate import Phase, poisson_arrivals
from worker.streams.server import RedisServer

COST = {"model": "echo", "model_options": {"delay_ms": 10, "per_item_ms": 1},
        "instances": 2, "max_batch_size": 32, "read_count": 256, "max_inflight": 4096}
STATICS = [(0.0, 32), (5.0, 32), (20.0, 32), (0.0, 8), (5.0, 8)]
PAYLOADS = [msgpack.packb({"n": i}) for i in range(64)]


def configs(target_ms: float, shed: bool) -> dict[str, dict[str, Any]]:
    redbatch = {**COST, "latency_target_ms": target_ms, "shed_over_target": shed}
    return {"redbatch": redbatch,
            **{f"static wait {w:g} batch {n}": {**COST, "max_wait_ms": w, "max_batch_size": n}
               for w, n in STATICS}}


def offsets(phases: Sequence[Phase], seed: int) -> list[float]:
    return [a.at_ms / 1000 for a in poisson_arrivals(phases, lambda rng: 1, seed)]


def summarise(timed: Sequence[Timed], sent_at: Sequence[float], phases: Sequence[Phase],
              target_ms: float) -> dict[str, Any]:
    total = sum(p.seconds for p in phases)
    count = int(-(-total // WINDOW_S))
    windows: list[list[float]] = [[] for _ in range(count)]
    goodput = [0] * len(phases)
    refused, refusal_ms, served_ms = 0, [], []
    bounds = [sum(p.seconds for p in phases[:i + 1]) for i in range(len(phases))]
    for one in timed:
        at = sent_at[int(one.envelope["id"][1:])]
        latency_ms = one.latency_s * 1000
        if not one.envelope["ok"]:
            refused += 1
            refusal_ms.append(latency_ms)
            continue
        served_ms.append(latency_ms)
        windows[min(count - 1, int(at // WINDOW_S))].append(latency_ms)
        phase = next(i for i, end in enumerate(bounds) if at < end or i == len(bounds) - 1)
        goodput[phase] += latency_ms <= target_ms
    return {"windows_p99_ms": [round(percentile(w, 0.99), 1) for w in windows],
            "goodput_per_phase": [round(g / p.seconds, 1) for g, p in zip(goodput, phases,
                                                                            strict=True)],
            "refused": refused,
            "admitted_within_t": round(sum(1 for s in served_ms if s <= target_ms)
                                       / max(1, len(served_ms)), 4),
            "refusal_p99_ms": round(percentile(refusal_ms, 0.99), 1)}


def run_config(url: str, name: str, settings: dict[str, Any], phases: Sequence[Phase],
               seed: int, target_ms: float, log_dir: Path) -> dict[str, Any]:
    namespace = "lat-" + "".join(ch if ch.isalnum() else "-" for ch in name)
    with Workers(url, namespace, 1, log_dir, **settings) as pool:
        pool.wait_until_reading()
        client = redis.Redis.from_url(url)
        drain(client, pool.stream, PAYLOADS * 8)  # warm: the cost model is learnt
        sent_at = offsets(phases, seed)
        timed = open_loop_at(url, pool.stream, PAYLOADS, sent_at)
        client.close()
    return summarise(timed, sent_at, phases, target_ms)


def saturation(url: str, log_dir: Path) -> float:
    with Workers(url, "lat-saturation", 1, log_dir, **COST) as pool:
        pool.wait_until_reading()
        client = redis.Redis.from_url(url)
        drain(client, pool.stream, PAYLOADS * 8)
        rate = max(drain(client, pool.stream, PAYLOADS * 100).rate for _ in range(2))
        client.close()
    return rate


def capacity(url: str, target_ms: float, seed: int, log_dir: Path) -> tuple[float, dict]:
    """The highest rate some static setting holds (a coarse sweep over shares of saturation)."""
    saturated = saturation(url, log_dir)
    held: dict[str, list[float]] = {}
    best = 0.0
    for share in (0.6, 0.7, 0.8, 0.9, 0.95):
        for wait in (0.0, 5.0):
            name = f"static wait {wait:g} batch 32"
            phases = [Phase(10.0, share * saturated)]
            row = run_config(url, name, {**COST, "max_wait_ms": wait}, phases, seed,
                             target_ms, log_dir)
            if max(row["windows_p99_ms"]) <= target_ms:
                held.setdefault(name, []).append(share)
                best = max(best, share * saturated)
    return best, {"saturated_per_s": round(saturated, 1), "shares_held": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency_bench")
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"target_ms": args.target_ms, "phase_s": args.phase_s}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        log_dir = Path(tmp)
        c, sweep = capacity(server.url, args.target_ms, args.seed, log_dir)
        results["capacity_per_s"], results["capacity_sweep"] = round(c, 1), sweep
        print("C", round(c, 1), sweep, flush=True)
        step = [Phase(args.phase_s, 0.25 * c), Phase(args.phase_s, 0.9 * c),
                Phase(args.phase_s, 0.25 * c)]
        over = [Phase(args.phase_s, 1.5 * c)]
        for goal, phases, shed in (("G1 step load", step, False), ("G3 overload", over, True)):
            results[goal] = {name: run_config(server.url, name, settings, phases, args.seed,
                                              args.target_ms, log_dir)
                             for name, settings in configs(args.target_ms, shed).items()}
            print(goal, json.dumps(results[goal], indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
