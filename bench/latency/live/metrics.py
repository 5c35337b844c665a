"""What the worker decided during a latency run, from its /metrics every `EVERY_S` seconds:
per 10 s window, the dispatch reasons, the requests per batch, how busy the device was and
the safety margin (`python -m bench.latency.live --sample-metrics`).

The scrapes run in a process of their own (`python -m bench.latency.live.metrics OUT PORT...`):
parsing /metrics in the benchmark's process would hold its GIL for milliseconds and delay
the open loop's sender, which must send on schedule.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from bench.common.processes import REPO_ROOT, scrape
from bench.latency.sim.goals import WINDOW_S

EVERY_S = 1.0
KEPT = ("redbatch_dispatches_total", "redbatch_batch_size_sum", "redbatch_batch_size_count",
        "redbatch_compute_seconds_sum", "redbatch_latency_margin_seconds",
        "redbatch_latency_observed_seconds")
Snapshot = tuple[float, dict[str, float]]  # the wall-clock time, the kept values by key


def kept(ports: Sequence[int]) -> dict[str, float]:
    """The sampled metrics, summed over the processes; a dispatch count keyed by reason."""
    values: dict[str, float] = {}
    for (name, labels), value in scrape(ports).items():
        if name in KEPT:
            key = f"{name}:{dict(labels).get('reason', '')}"
            values[key] = values.get(key, 0.0) + value
    return values


def sample_until_stopped(out: Path, ports: Sequence[int]) -> None:
    """The sampling process: scrape until SIGTERM, then write the snapshots to `out`."""
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    snapshots = [(time.time(), kept(ports))]
    print("sampling", flush=True)  # the first snapshot is taken: the arrivals may start
    while not stopping.wait(EVERY_S):
        snapshots.append((time.time(), kept(ports)))
    out.write_text(json.dumps(snapshots))


def per_window(snapshots: Sequence[Snapshot], started_at: float,
               windows: int) -> list[dict[str, Any]]:
    """The decisions of each 10 s window of arrivals that began at `started_at` (wall
    clock), from the last snapshots at or before the window's ends."""
    def at(seconds: float) -> Snapshot | None:
        earlier = [s for s in snapshots if s[0] - started_at <= seconds]
        return earlier[-1] if earlier else None

    rows = []
    for index in range(windows):
        start, end = at(index * WINDOW_S), at((index + 1) * WINDOW_S)
        if start is None or end is None or end[0] <= start[0]:
            continue
        rows.append(window_row(index, start, end))
    return rows


def window_row(index: int, start: Snapshot, end: Snapshot) -> dict[str, Any]:
    def delta(key: str) -> float:
        return end[1].get(key, 0.0) - start[1].get(key, 0.0)

    batches = delta("redbatch_batch_size_count:")
    reasons = {key.partition(":")[2]: int(delta(key)) for key in end[1]
               if key.startswith("redbatch_dispatches_total:") and delta(key)}
    return {"window": index, "reasons": reasons,
            "per_batch": round(delta("redbatch_batch_size_sum:") / batches, 2) if batches else 0,
            "busy": round(delta("redbatch_compute_seconds_sum:") / (end[0] - start[0]), 2),
            "margin_ms": round(end[1].get("redbatch_latency_margin_seconds:", 0.0) * 1000),
            "observed_ms": round(end[1].get("redbatch_latency_observed_seconds:", 0.0) * 1000)}


class MetricSampling:
    """Samples a pool's /metrics from another process while the arrivals run."""

    def __init__(self, ports: Sequence[int], out: Path) -> None:
        self.ports, self.out = ports, out
        self.snapshots: list[Snapshot] = []
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> MetricSampling:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.latency.live.metrics", str(self.out),
             *map(str, self.ports)], cwd=REPO_ROOT, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "sampling", or nothing if it failed to start
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(timeout=30)
        if self.out.exists():
            self.snapshots = [(t, values) for t, values in json.loads(self.out.read_text())]


if __name__ == "__main__":
    sample_until_stopped(Path(sys.argv[1]), [int(port) for port in sys.argv[2:]])
