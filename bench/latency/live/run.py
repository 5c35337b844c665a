"""The latency target on real processes: `python -m bench.latency.live`.

Worker processes on an embedded Redis serve the echo cost model (10 ms per batch + 1 ms
per request, two instances), and an open-loop producer (bench/latency/live/open_loop.py) sends
the same seeded Poisson arrivals to each configuration in turn: redbatch with
`latency_target_ms`, static settings swept over max_wait_ms and max_batch_size (baseline
1), and the adaptive baselines as the worker runs them (`batch_controller`: aimd, step,
dynamic_timeout, the simulator's own controllers, worker/policy/controllers.py; and cork,
BentoML's CorkDispatcher, worker/policy/cork.py). `--model minilm` serves the real MiniLM
encoder instead of the echo cost model. The goals G1-G5 and their loads:
bench/latency/live/goals.py.
C is measured as the issue defines it, coarsely: the highest of 60-95 % of the saturated
rate (`--shares` for a finer sweep) at which a static setting (wait 0 or 5 ms, batch 32)
still holds p99 <= T over 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from bench.common.load import drain
from bench.common.processes import Workers
from bench.latency.live.goals import (
    DEVICES,
    ECHO_DEVICE,
    PAYLOADS,
    Device,
    Goal,
    configs,
    goals,
)
from bench.latency.live.metrics import MetricSampling, per_window
from bench.latency.live.open_loop import open_loop_ids, summarise
from bench.latency.sim.goals import two_peaks
from bench.latency.sim.simulate import Phase
from worker.cli_flags import positive
from worker.execution.cores import available_cores
from worker.streams.server import RedisServer

WARM_BURST = 8  # the burst warm-up: PAYLOADS this many times over, sent at once
SHARES = (0.6, 0.7, 0.8, 0.9, 0.95)  # of the saturated rate, where the sweep looks for C


def warm_up(url: str, stream: str, payloads: Sequence[bytes], paced_rate: float | None,
            timeout_s: float) -> int:
    """Warm the worker (the cost model is learnt); how many requests that sent. Paced: 3 s
    at `paced_rate`, evenly spaced, instead of a burst of 512 at once (which a controller of
    the batch cap may never recover from)."""
    if paced_rate:
        sent_at = [i / paced_rate for i in range(int(3 * paced_rate))]
        open_loop_ids(url, stream, payloads, sent_at, timeout_s)
        return len(sent_at)
    client = redis.Redis.from_url(url)
    burst = list(payloads[:len(PAYLOADS)]) * WARM_BURST
    drain(client, stream, burst)
    client.close()
    return len(burst)


def warm_count(paced_rate: float | None) -> int:
    """How many requests warm_up sends, known before it runs (for the drift's count)."""
    return int(3 * paced_rate) if paced_rate else len(PAYLOADS) * WARM_BURST


def run_config(url: str, name: str, settings: dict[str, Any], goal: Goal, seed: int,
               target_ms: float, log_dir: Path, timeout_s: float = 120.0,
               paced_rate: float | None = None, device: Device = ECHO_DEVICE,
               sampled: bool = False) -> dict[str, Any]:
    """One configuration through one goal's arrivals, warmed up first. A namespace of its
    own per goal: a run that left requests unanswered leaves them in its stream, and the
    next goal's worker would serve that backlog first (and reply to this receiver).
    `sampled`: the worker's decisions per window too (`dispatch`, bench/latency/live/metrics.py)."""
    namespace = "lat-" + "".join(ch if ch.isalnum() else "-" for ch in f"{goal.name} {name}")
    sent_at, lengths = goal.arrivals(seed)
    payloads = device.payloads(lengths)
    settings = goal.settings(settings, warm_count(paced_rate), sent_at, device)
    with Workers(url, namespace, 1, log_dir, **settings) as pool:
        pool.wait_until_reading()
        warm_up(url, pool.stream, payloads, paced_rate, timeout_s)
        sampling = MetricSampling(pool.ports, log_dir / f"{namespace}-metrics.json")
        with sampling if sampled else contextlib.nullcontext():
            started_at = time.time()
            samples = open_loop_ids(url, pool.stream, payloads, sent_at, timeout_s)
    row = summarise(samples, sent_at, goal.phases, target_ms, lengths, device.boundaries)
    if sampled:
        row["dispatch"] = per_window(sampling.snapshots, started_at,
                                     len(row["windows_p99_ms"]))
    return row


def saturation(url: str, log_dir: Path, device: Device = ECHO_DEVICE) -> float:
    """The drain rate of a queue of requests (MiniLM: 64 of the two-peaked mix, repeated)."""
    payloads = device.payloads(device.sample_lengths())
    with Workers(url, "lat-saturation", 1, log_dir, **device.base) as pool:
        pool.wait_until_reading()
        client = redis.Redis.from_url(url)
        drain(client, pool.stream, payloads * 8)
        queue = payloads * device.saturation_repeats
        rate = max(drain(client, pool.stream, queue).rate for _ in range(2))
        client.close()
    return rate


def capacity(url: str, target_ms: float, seed: int, log_dir: Path,
             device: Device = ECHO_DEVICE,
             shares: Sequence[float] = SHARES) -> tuple[float, dict]:
    """The highest rate some static setting holds (a sweep over shares of saturation)."""
    saturated = saturation(url, log_dir, device)
    lengths = two_peaks if device.mixed else None
    held: dict[str, list[float]] = {}
    worst: dict[str, dict[str, float]] = {}  # each share's worst window, to see by how much
    best = 0.0
    for share in shares:
        for wait in (0.0, 5.0):
            name = f"static wait {wait:g} batch 32"
            goal = Goal("sweep", [Phase(10.0, share * saturated)], lengths=lengths)
            row = run_config(url, name, {**device.base, "max_wait_ms": wait}, goal, seed,
                             target_ms, log_dir, device=device)
            worst_ms = worst.setdefault(name, {})[f"{share:g}"] = max(row["windows_p99_ms"])
            if worst_ms <= target_ms:
                held.setdefault(name, []).append(share)
                best = max(best, share * saturated)
    return best, {"saturated_per_s": round(saturated, 1), "shares_held": held,
                  "worst_window_p99_ms": worst}


positive_int = positive(int)
positive_float = positive(float)  # a rate, in requests/s


def shares_list(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(one) for one in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not all(0 < one <= 1.5 for one in shares):
        raise argparse.ArgumentTypeError("shares of the saturated rate lie in (0, 1.5]")
    return shares


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.latency.live")
    parser.add_argument("--model", choices=sorted(DEVICES), default="echo", help="echo (its "
                        "cost model) or minilm (the real encoder, two-peaked lengths)")
    parser.add_argument("--target-ms", type=float, default=None,
                        help="T (ms); default 100 on echo, 250 on minilm")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--capacity", type=positive_float, default=None,
                        help="use this C instead of sweeping for it (a check, not a result)")
    parser.add_argument("--shares", type=shares_list, default=SHARES, help="the shares of "
                        "the saturated rate the sweep for C tries, e.g. 0.62,0.64,0.66")
    parser.add_argument("--g5-capacity", type=float, default=None, help="C of G5's cost "
                        "model (default: C scaled by the simulator's ratio of the two)")
    parser.add_argument("--only", action="append", default=None,
                        help="run only this configuration (repeatable), e.g. redbatch")
    parser.add_argument("--goals", default="G1,G3", help="which goals to run, e.g. G2,G4,G5")
    parser.add_argument("--paced-warmup", action="store_true", help="warm up at 25 %% of C "
                        "for 3 s instead of with a burst of 512 requests")
    parser.add_argument("--sample-metrics", action="store_true", help="record the worker's "
                        "decisions per 10 s window (dispatch reasons, requests per batch, "
                        "device busy, margin) from its /metrics")
    parser.add_argument("--instances", type=positive_int, default=None, help="model instances per "
                        "worker, for every configuration (default: the device's own, 2 on "
                        "echo and the worker's `auto` on minilm: one per core)")
    parser.add_argument("--rounds", type=positive_int, default=1, help="run each goal's "
                        "configurations this many times in turn (A B, A B, ...), so that "
                        "the report can give each one's median beside the single runs")
    parser.add_argument("--reply-timeout-s", type=float, default=120.0, help="how long "
                        "after the last arrival to wait for replies (the rest: unanswered)")
    return parser


def run_goals(args: argparse.Namespace, url: str, log_dir: Path, c: float,
              results: dict[str, Any]) -> None:
    """Every chosen configuration through every chosen goal, `--rounds` times in turn (the
    first round's rows are the goal's, the later ones under `later_rounds`)."""
    device = chosen_device(args)
    for goal in goals(c, args.phase_s, args.goals.split(","), args.g5_capacity, device):
        chosen = {name: settings for name, settings in configs(args.target_ms, goal.shed,
                                                               device.base).items()
                  if args.only is None or name in args.only}
        results.setdefault("goal_settings", {})[goal.name] = goal.described(device.base)
        for round_index in range(args.rounds):
            rows: dict[str, Any] = {}
            if round_index == 0:
                results[goal.name] = rows
            else:
                results.setdefault("later_rounds", {}).setdefault(goal.name, []).append(rows)
            run_round(args, url, log_dir, c, device, goal, chosen, rows, results)
        print(goal.name, json.dumps(results[goal.name], indent=1), flush=True)


def run_round(args: argparse.Namespace, url: str, log_dir: Path, c: float, device: Device,
              goal: Goal, chosen: dict[str, dict[str, Any]], rows: dict[str, Any],
              results: dict[str, Any]) -> None:
    """Each chosen configuration once through the goal's arrivals, into `rows`; the JSON
    written after each, should a run stop."""
    for name, settings in chosen.items():
        print(goal.name, "/", name, flush=True)
        rows[name] = run_config(url, name, settings, goal, args.seed, args.target_ms, log_dir,
                                args.reply_timeout_s, 0.25 * c if args.paced_warmup else None,
                                device, args.sample_metrics)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")


def chosen_device(args: argparse.Namespace) -> Device:
    """The device `--model` names, with `--instances` if given."""
    device = DEVICES[args.model]
    if args.instances is None:
        return device
    return replace(device, base={**device.base, "instances": args.instances})


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = chosen_device(args)
    if args.target_ms is None:
        args.target_ms = device.target_ms
    known = set(configs(args.target_ms, False))
    if set(args.only or []) - known:
        parser().error(f"--only: no configuration {sorted(set(args.only) - known)}; "
                       f"there are {sorted(known)}")
    try:  # an unknown goal is refused before anything runs
        goals(1.0, args.phase_s, args.goals.split(","), device=device)
    except ValueError as exc:
        parser().error(f"--goals: {exc}")
    results: dict[str, Any] = {"model": args.model, "instances": device.base["instances"],
                               "cores": available_cores(),
                               "target_ms": args.target_ms,
                               "phase_s": args.phase_s,
                               "paced_warmup": args.paced_warmup, "seed": args.seed,
                               "rounds_per_goal": args.rounds,
                               "load_average_at_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        log_dir = Path(tmp)
        if args.capacity is None:
            c, results["capacity_sweep"] = capacity(server.url, args.target_ms, args.seed,
                                                    log_dir, device, args.shares)
        else:
            c = args.capacity
        results["capacity_per_s"] = round(c, 1)
        print("C", round(c, 1), results.get("capacity_sweep"), flush=True)
        if c > 0:
            run_goals(args, server.url, log_dir, c, results)
        else:  # every goal's load is a share of C: nothing to run
            print(f"no share of the saturated rate held p99 <= {args.target_ms:g} ms; "
                  "try lower --shares", flush=True)
    results["load_average_at_end"] = list(os.getloadavg())
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if c > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
