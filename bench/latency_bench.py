"""The latency target on real processes: `python -m bench.latency_bench`.

Worker processes on an embedded Redis serve the echo cost model (10 ms per batch + 1 ms
per request, two instances), and an open-loop producer sends the same seeded Poisson
arrivals to each configuration in turn: redbatch with `latency_target_ms`, static
settings swept over max_wait_ms and max_batch_size (baseline 1), and the adaptive baselines
2-4 as the worker runs them (`batch_controller`: aimd, step, dynamic_timeout, the simulator's
own controllers, worker/policy/controllers.py). G1 is the step load 25 % -> 90 % -> 25 % of
C; G3 is 150 % of C, with `shed_over_target` for redbatch (the baselines cannot shed).
C is measured as the issue defines it, coarsely: the highest of 60-95 % of the saturated
rate at which a static setting (wait 0 or 5 ms, batch 32) still holds p99 <= T over 10 s.

BentoML's CorkDispatcher (baseline 5) exists only in the simulator (bench/baselines.py,
reported by `python -m bench.latency_goals`): it is a dispatch rule, not a worker setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis

from bench.cluster import Workers
from bench.latency_goals import WINDOW_S, percentile
from bench.load import drain
from bench.simulate import Phase, poisson_arrivals
from producer import protocol
from worker.streams.server import RedisServer

COST = {"model": "echo", "model_options": {"delay_ms": 10, "per_item_ms": 1},
        "instances": 2, "max_batch_size": 32, "read_count": 256, "max_inflight": 4096}
STATICS = [(0.0, 32), (5.0, 32), (20.0, 32), (0.0, 8), (5.0, 8)]
PAYLOADS = [msgpack.packb({"n": i}) for i in range(64)]


def configs(target_ms: float, shed: bool) -> dict[str, dict[str, Any]]:
    redbatch = {**COST, "latency_target_ms": target_ms, "shed_over_target": shed}
    return {"redbatch": redbatch,
            **{f"static wait {w:g} batch {n}": {**COST, "max_wait_ms": w, "max_batch_size": n}
               for w, n in STATICS},
            **{name: {**COST, **extra} for name, extra in baselines(target_ms).items()}}


def baselines(target_ms: float) -> dict[str, dict[str, Any]]:
    """The adaptive baselines as worker settings, started as the simulator starts them (AIMD
    and step dispatch at once, the dynamic timeout waits 10 ms); none of them sheds."""
    return {"aimd": {"batch_controller": "aimd", "controller_target_ms": target_ms,
                     "max_wait_ms": 0.0},
            "step": {"batch_controller": "step", "controller_target_ms": target_ms,
                     "max_wait_ms": 0.0},
            "dynamic timeout": {"batch_controller": "dynamic_timeout"}}


def offsets(phases: Sequence[Phase], seed: int) -> list[float]:
    return [a.at_ms / 1000 for a in poisson_arrivals(phases, lambda rng: 1, seed)]


@dataclass(frozen=True)
class Sample:
    """One request of an open-loop run, timed both ways."""

    index: int
    client_ms: float  # from before the XADD call to the reply popped (the producer's view)
    xadd_ms: float  # from the XADD time (the entry id) to the reply popped: the issue's
    envelope: dict[str, Any]  # definition, up to the receiver's own lag (so never less)


class Sender:
    """The open loop's producer: XADD at the scheduled offsets, keeping each entry id. On
    schedule one XADD each; behind it, what is due in one pipeline (a round trip each would
    leave the schedule further behind, and the arrivals burstier than Poisson)."""

    def __init__(self, url: str, stream: str, payloads: Sequence[bytes],
                 offsets: Sequence[float], reply_to: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.stream, self.payloads, self.offsets, self.reply_to = (stream, payloads, offsets,
                                                                  reply_to)
        self.sent: list[tuple[float, int]] = [(0.0, 0)] * len(offsets)  # perf s, XADD ms
        self.late: list[float] = [0.0] * len(offsets)  # behind the schedule, in s

    def run(self) -> None:
        start, index, offsets = time.perf_counter(), 0, self.offsets
        while index < len(offsets):
            delay = start + offsets[index] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            before = time.perf_counter()
            due = index + 1
            while due < len(offsets) and due - index < 64 and start + offsets[due] <= before:
                due += 1
            pipe = self.client.pipeline(transaction=False)
            for i in range(index, due):
                self.late[i] = before - start - offsets[i]
                pipe.xadd(self.stream, protocol.entry_fields(  # type: ignore[arg-type]
                    f"p{i}", self.payloads[i % len(self.payloads)], reply_to=self.reply_to))
            for i, entry_id in zip(range(index, due), pipe.execute(), strict=True):
                self.sent[i] = (before, int(entry_id.partition(b"-")[0]))
            index = due
        self.client.close()

    def lag(self) -> str:
        if not self.late:
            return "sender: nothing sent"
        worst = max(range(len(self.late)), key=self.late.__getitem__)
        p99 = sorted(self.late)[int(0.99 * len(self.late))]
        return (f"sender: worst lag {self.late[worst] * 1000:.1f} ms at "
                f"{self.offsets[worst]:.3f} s, p99 {p99 * 1000:.2f} ms")


def open_loop_ids(url: str, stream: str, payloads: Sequence[bytes],
                  offsets: Sequence[float], timeout_s: float = 120.0) -> list[Sample]:
    """Send at the given offsets regardless of replies; pop replies in bulk (BLPOP, then
    LPOP of what else is there) so the receiver lags little. The bench process collects
    no garbage meanwhile: a collection once stalled the sender ~100 ms, then it sent the
    lost arrivals in a burst (right at G1's step up, in every run)."""
    reply_to = f"{stream}:bench-open-loop"
    popped: list[tuple[float, float, bytes]] = []
    receiver = redis.Redis.from_url(url)
    receiver.delete(reply_to)
    sender = Sender(url, stream, payloads, offsets, reply_to)
    thread = threading.Thread(target=sender.run, name="bench-sender", daemon=True)
    gc.disable()
    thread.start()
    deadline = time.perf_counter() + (offsets[-1] if offsets else 0.0) + timeout_s
    while len(popped) < len(offsets) and time.perf_counter() < deadline:
        first: Any = receiver.blpop([reply_to], timeout=1)
        if first is None:
            continue
        more: Any = receiver.lpop(reply_to, 1000) or []
        wall, perf = time.time() * 1000, time.perf_counter()
        popped += [(wall, perf, data) for data in [first[1], *more]]
    thread.join()
    gc.enable()
    receiver.close()
    print(sender.lag(), flush=True)
    if len(popped) < len(offsets):  # the rest count as unanswered, not within T
        print(f"{len(popped)} of {len(offsets)} open-loop replies arrived", flush=True)
    samples = []
    for wall, perf, data in popped:
        envelope = protocol.decode_envelope(data)
        index = int(envelope["id"][1:])
        before, entry_ms = sender.sent[index]
        samples.append(Sample(index, (perf - before) * 1000, wall - entry_ms, envelope))
    return samples


def summarise(samples: Sequence[Sample], sent_at: Sequence[float], phases: Sequence[Phase],
              target_ms: float) -> dict[str, Any]:
    """Per window of sending times, the percentile of served latencies (from the XADD
    time, as the issue defines it; `client_*` from before the XADD call); goodput per
    phase; admitted within T; refusals' speed."""
    total = sum(p.seconds for p in phases)
    count = int(-(-total // WINDOW_S))
    windows: list[list[float]] = [[] for _ in range(count)]
    client_windows: list[list[float]] = [[] for _ in range(count)]
    goodput = [0] * len(phases)
    refusal_ms, client_refusal_ms, served_ms = [], [], []
    bounds = [sum(p.seconds for p in phases[:i + 1]) for i in range(len(phases))]
    for one in samples:
        at = sent_at[one.index]
        if not one.envelope["ok"]:
            refusal_ms.append(one.xadd_ms)
            client_refusal_ms.append(one.client_ms)
            continue
        served_ms.append(one.xadd_ms)
        window = min(count - 1, int(at // WINDOW_S))
        windows[window].append(one.xadd_ms)
        client_windows[window].append(one.client_ms)
        phase = next(i for i, end in enumerate(bounds) if at < end or i == len(bounds) - 1)
        goodput[phase] += one.xadd_ms <= target_ms
    return {"windows_p99_ms": [round(percentile(w, 0.99), 1) for w in windows],
            "client_windows_p99_ms": [round(percentile(w, 0.99), 1) for w in client_windows],
            "goodput_per_phase": [round(g / p.seconds, 1) for g, p in zip(goodput, phases,
                                                                            strict=True)],
            "refused": len(refusal_ms), "unanswered": len(sent_at) - len(samples),
            "admitted_within_t": round(sum(1 for s in served_ms if s <= target_ms)
                                       / max(1, len(served_ms)), 4),
            "refusal_p99_ms": round(percentile(refusal_ms, 0.99), 1),
            "refusal_max_ms": round(max(refusal_ms, default=0.0), 1),
            "client_refusal_p99_ms": round(percentile(client_refusal_ms, 0.99), 1),
            "load_average": [round(v, 2) for v in os.getloadavg()]}


def run_config(url: str, name: str, settings: dict[str, Any], phases: Sequence[Phase],
               seed: int, target_ms: float, log_dir: Path, timeout_s: float = 120.0,
               paced_rate: float | None = None) -> dict[str, Any]:
    """`paced_rate`: warm up with 3 s of evenly spaced requests at this rate instead of
    a burst of 512 at once (which a controller of the batch cap may never recover from)."""
    namespace = "lat-" + "".join(ch if ch.isalnum() else "-" for ch in name)
    with Workers(url, namespace, 1, log_dir, **settings) as pool:
        pool.wait_until_reading()
        client = redis.Redis.from_url(url)
        if paced_rate:
            open_loop_ids(url, pool.stream, PAYLOADS, [i / paced_rate for i in
                                                       range(int(3 * paced_rate))], timeout_s)
        else:
            drain(client, pool.stream, PAYLOADS * 8)  # warm: the cost model is learnt
        sent_at = offsets(phases, seed)
        samples = open_loop_ids(url, pool.stream, PAYLOADS, sent_at, timeout_s)
        client.close()
    return summarise(samples, sent_at, phases, target_ms)


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
    parser.add_argument("--capacity", type=float, default=None,
                        help="use this C instead of sweeping for it (a check, not a result)")
    parser.add_argument("--only", action="append", default=None,
                        help="run only this configuration (repeatable), e.g. redbatch")
    parser.add_argument("--goals", default="G1,G3", help="which goals to run, e.g. G3")
    parser.add_argument("--paced-warmup", action="store_true", help="warm up at 25 %% of C "
                        "for 3 s instead of with a burst of 512 requests")
    parser.add_argument("--reply-timeout-s", type=float, default=120.0, help="how long "
                        "after the last arrival to wait for replies (the rest: unanswered)")
    args = parser.parse_args(argv)
    unknown = set(args.only or []) - set(configs(args.target_ms, False))
    if unknown:
        parser.error(f"--only: no configuration {sorted(unknown)}; "
                     f"there are {sorted(configs(args.target_ms, False))}")
    results: dict[str, Any] = {"target_ms": args.target_ms, "phase_s": args.phase_s,
                               "paced_warmup": args.paced_warmup,
                               "load_average_at_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        log_dir = Path(tmp)
        if args.capacity is None:
            c, sweep = capacity(server.url, args.target_ms, args.seed, log_dir)
            results["capacity_sweep"] = sweep
        else:
            c = args.capacity
        results["capacity_per_s"] = round(c, 1)
        print("C", round(c, 1), results.get("capacity_sweep"), flush=True)
        for goal, phases, shed in goals(c, args.phase_s, args.goals.split(",")):
            chosen = {name: settings for name, settings in configs(args.target_ms, shed).items()
                      if args.only is None or name in args.only}
            results[goal] = {}
            for name, settings in chosen.items():  # written after each, should a run stop
                results[goal][name] = run_config(server.url, name, settings, phases,
                                                 args.seed, args.target_ms, log_dir,
                                                 args.reply_timeout_s,
                                                 0.25 * c if args.paced_warmup else None)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
            print(goal, json.dumps(results[goal], indent=1), flush=True)
    return 0


def goals(c: float, phase_s: float, wanted: Sequence[str]) -> list[tuple[str, list[Phase], bool]]:
    """G1 (step load, no shedding) and G3 (overload, shedding on) as phases of load."""
    step = [Phase(phase_s, 0.25 * c), Phase(phase_s, 0.9 * c), Phase(phase_s, 0.25 * c)]
    every = [("G1 step load", step, False), ("G3 overload", [Phase(phase_s, 1.5 * c)], True)]
    return [g for g in every if g[0].split()[0] in wanted]


if __name__ == "__main__":
    raise SystemExit(main())
