"""Where the time goes in a latency-target worker: `python -m bench.latency.live.probe`.

A diagnostic, not a benchmark of record. It runs the worker (`python -m worker run`) in a process
that first wraps a few of the pipeline's methods to stamp times (the worker's own code is
untouched), drives it with the benchmark's open-loop arrivals, and prints each request's path split
in parts: XADD -> read by the intake, read -> queued or refused, queued -> batch launch, compute,
batch done -> reply written, and the reply thread's and the intake's own rounds. `python -m
bench.latency.live.probe worker ...` is the wrapped worker. Experiments, by environment:
REDBATCH_PROBE_SWITCH_S (the GIL's switch interval in the worker) and REDBATCH_PROBE_NO_GC (no
garbage collection in the worker).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.processes import REPO_ROOT, Workers, worker_command
from bench.latency.live.probe_cpu import cpu_s, profile, summarise_profile
from bench.latency.live.probe_stamps import EVENTS, install
from bench.latency.sim.goals import percentile


def run_worker(argv: list[str]) -> int:
    out = os.environ["REDBATCH_PROBE_OUT"]
    if os.environ.get("REDBATCH_PROBE_SWITCH_S"):  # an experiment: the GIL's switch interval
        sys.setswitchinterval(float(os.environ["REDBATCH_PROBE_SWITCH_S"]))
    if os.environ.get("REDBATCH_PROBE_NO_GC"):  # an experiment: no collection pauses
        gc.disable()
    install()
    atexit.register(lambda: Path(out).write_text(json.dumps(EVENTS)))
    from worker.cli import main as worker_main

    return worker_main(argv)


class ProbedWorkers(Workers):
    """Workers whose processes are the wrapped worker."""

    def __init__(self, *args: Any, out: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.out = out

    def start(self) -> ProbedWorkers:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "REDBATCH_PROBE_OUT": str(self.out)}
        for index, port in enumerate(self.ports):
            command = worker_command(self.redis_url, self.namespace, port, self.settings)
            command[1:3] = ["-m", "bench.latency.live.probe", "worker"]
            with self.log_path(index).open("wb") as log:
                self.processes.append(subprocess.Popen(command, cwd=REPO_ROOT, env=env,
                                                       stdout=log, stderr=subprocess.STDOUT))
        return self


def spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return (f"p50 {percentile(values, 0.5):.1f} p90 {percentile(values, 0.9):.1f} "
            f"p99 {percentile(values, 0.99):.1f} max {max(values):.1f} (n={len(values)})")


def analyse(events: dict[str, list[Any]], window: tuple[float, float] | None = None) -> None:
    """Print the parts of each path."""
    reads, refused, batches = events["reads"], events["refused"], events["batches"]
    print("intake round (ms):", spread([e - s for s, e, *_ in reads]))
    print("entries per read:", spread([n for _, _, n, *_ in reads]))
    print("XADD -> read, oldest of a read (ms):", spread([s - lo for s, _, n, lo, _ in reads if n]))
    print("refusal: XADD -> decided (ms):", spread([d - x for x, _, d in refused]))
    written: dict[float, list[float]] = {}
    for enq, end, status, *_ in events["answers"]:
        if status == "overloaded":
            written.setdefault(enq, []).append(end)
    print("refusal: XADD -> written, by ms (ms):",
          spread([e - x for x, ends in written.items() for e in ends]))
    print("reply round (ms):", spread([e - s for s, e, _ in events["writes"]]))
    print("answers per reply round:", spread([n for *_, n in events["writes"]]))
    print("batch size:", spread([b[4] for b in batches]))
    print("compute (ms):", spread([b[2] for b in batches]))
    print("oldest member: XADD -> launch (ms):", spread([b[1] - b[5] for b in batches]))
    print("launch+compute -> answers built (ms):",
          spread([b[3] - b[1] - b[2] for b in batches]))
    reasons: dict[str, int] = {}
    for b in batches:
        reasons[b[7]] = reasons.get(b[7], 0) + 1
    print("reasons:", reasons)
    ok = [(end - enq) for enq, end, status, *_ in events["answers"] if status == "ok"]
    print("served XADD -> written (ms):", spread(ok))
    written_at = {a[3]: a[1] for a in events["answers"]}
    errors = [written_at[e] - now - predicted for e, now, admitted, predicted
              in events.get("admissions", []) if admitted and e in written_at]
    print("admitted: written - predicted completion (ms):", spread(errors))
    timeline(events)


def timeline(events: dict[str, list[Any]]) -> None:
    """Per second of XADD time: served p99 and max, batches, their mean size and reasons,
    and the policy's margin, ratio quantile, fitted costs and queue length."""
    answers = [(enq, end - enq) for enq, end, status, *_ in events["answers"] if status == "ok"]
    if not answers:
        return
    start = min(enq for enq, _ in answers)
    per: dict[int, dict[str, Any]] = {}

    def slot(t: float) -> dict[str, Any]:
        return per.setdefault(int((t - start) // 1000), {"lat": [], "sizes": [], "why": {},
                                                          "pol": None, "wait": []})

    for enq, latency in answers:
        slot(enq)["lat"].append(latency)
    for b in events["batches"]:
        s = slot(b[1])
        s["sizes"].append(b[4])
        s["why"][b[7]] = s["why"].get(b[7], 0) + 1
        s["wait"].append(b[1] - b[5])
    for p in events["policy"]:
        if p[0] >= start:
            slot(p[0])["pol"] = p[1:]
    print("s  served_p99 max | batches mean_size oldest_wait_max reasons | margin ratio fixed "
          "per_item queued busy_in")
    for second in sorted(per):
        s = per[second]
        pol: Any = s["pol"] or (0, 0, 0, 0, 0, [])
        mean = sum(s["sizes"]) / max(1, len(s["sizes"]))
        print(f"{second:3d} {percentile(s['lat'], 0.99):6.1f} {max(s['lat'], default=0):6.1f} | "
              f"{len(s['sizes']):3d} {mean:5.1f} {max(s['wait'], default=0):6.1f} {s['why']} | "
              f"{pol[0]:5.1f} {pol[1]:5.2f} {pol[2]:5.1f} {pol[3]:5.2f} {pol[4]:4d} {pol[5]}")


def drive(args: argparse.Namespace) -> None:
    """One goal's arrivals through a probed worker; the figures, then where the time went."""
    from bench.latency.live.goals import COST, goals, offsets
    from bench.latency.live.open_loop import summarise
    from worker.streams.server import RedisServer

    goal = goals(args.capacity, args.phase_s, [args.goal])[0]  # the benchmark's own loads
    settings = {**COST, "latency_target_ms": args.target_ms, "shed_over_target": goal.shed,
                **json.loads(args.settings)}
    sent_at = offsets(goal.phases, args.seed)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        out = Path(tmp) / "events.json"
        with ProbedWorkers(server.url, "probe", 1, Path(tmp), out=out, **settings) as pool:
            assert server.process is not None
            samples = run_probed(pool, server.url, server.process.pid, sent_at, args.spy,
                                 Path(tmp))
        for _ in range(100):  # the worker writes its events as it exits
            if out.exists():
                break
            time.sleep(0.1)
        print(json.dumps(summarise(samples, sent_at, goal.phases, args.target_ms)))
        events = json.loads(out.read_text())
        if args.keep:
            Path(args.keep).write_text(json.dumps(events))
    analyse(events)


def run_probed(pool: ProbedWorkers, url: str, redis_pid: int, sent_at: Sequence[float],
               spy: bool, tmp: Path) -> list[Any]:
    """Warm the worker, send the arrivals; print the CPU each process used meanwhile."""
    import redis

    from bench.common.load import drain
    from bench.latency.live.goals import PAYLOADS
    from bench.latency.live.open_loop import open_loop_ids

    pool.wait_until_reading()
    client = redis.Redis.from_url(url)
    drain(client, pool.stream, PAYLOADS * 8)
    client.close()
    pids = {"worker": pool.processes[0].pid, "redis": redis_pid}
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    bench_before = sum(os.times()[:2])
    profiler = profile(pids["worker"], sent_at[-1], tmp / "spy.txt") if spy else None
    samples = open_loop_ids(url, pool.stream, PAYLOADS, sent_at)
    if profiler is not None:
        profiler.wait()
        summarise_profile(tmp / "spy.txt")
    used = {name: round(cpu_s(pid) - before[name], 2) for name, pid in pids.items()}
    used["bench"] = round(sum(os.times()[:2]) - bench_before, 2)
    print("CPU seconds during the run:", used, f"over {sent_at[-1]:.0f} s;",
          round(used["worker"] * 1e6 / len(sent_at), 1), "µs of worker CPU per request",
          flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return run_worker(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.latency.live.probe")
    parser.add_argument("goal", choices=["G1", "G3"])
    parser.add_argument("--capacity", type=float, default=1422.6)
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settings", default="{}", help="worker settings as JSON")
    parser.add_argument("--keep", default=None, help="write the events here")
    parser.add_argument("--spy", action="store_true", help="profile the worker with py-spy")
    args = parser.parse_args(argv)
    print("uptime:", os.getloadavg(), flush=True)
    drive(args)
    print("uptime:", os.getloadavg(), flush=True)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "probe"
    raise SystemExit(main())
