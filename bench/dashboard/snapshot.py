"""Draw the Grafana dashboard's main panels from a real run (Grafana cannot run here).

Starts a redis-server and a real worker process, sends waves of the sample sentences, scrapes
the worker's /metrics every second, prints `python -m worker stats` in the middle of a wave,
and draws throughput, latency percentiles, batch sizes, padding efficiency, backlog and memory
with the same formulas as configs/grafana/dashboards/redbatch.json.

    python -m bench.dashboard --out docs/dashboard.png [--waves 3] [--texts 400] [--pause 15]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.common.paths import REPO_ROOT
from producer import Client  # noqa: E402
from worker.streams.server import RedisServer, free_port  # noqa: E402

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]
ROOT = REPO_ROOT
LEAD_IN_S = 6.0


def scrape(url: str) -> Sample:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(sample: Sample, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in sample.items()
               if n == name and all(dict(labels).get(k) == x for k, x in match.items()))


def by_label(sample: Sample, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in sample.items():
        if n == name and label in dict(labels):
            out[dict(labels)[label]] += v
    return out


def quantile(q: float, old: Sample, new: Sample, name: str) -> float:
    """Prometheus' histogram_quantile over the increase between two scrapes."""
    buckets: dict[float, float] = defaultdict(float)
    for (n, labels), v in new.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] += v - old.get((n, labels), 0.0)
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    rank, previous_le, previous_count = q * ordered[-1][1], 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return previous_le
            return previous_le + (le - previous_le) * (rank - previous_count) / max(
                count - previous_count, 1e-9)
        previous_le, previous_count = le, count
    return math.nan


def run_load(redis_url: str, texts: list[str], waves: int, pause_s: float) -> None:
    """`waves` bursts of the texts, `pause_s` apart; the replies pile up on one key."""
    client = Client(redis_url, "minilm")
    reply_to = client.new_reply_key()
    time.sleep(LEAD_IN_S)  # idle scrapes first, so every rate window sees the first wave
    for _ in range(waves):
        client.submit_many([{"text": t} for t in texts], reply_to=reply_to)
        time.sleep(pause_s)


def wait_until_ready(worker: subprocess.Popen[bytes], base: str) -> None:
    """Until the worker's /readyz answers (it warms up first), at most 3 minutes."""
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{base}/readyz", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit("the worker did not become ready") from None
            time.sleep(0.5)


def scrape_waves(base: str, redis_url: str, texts: list[str], args: argparse.Namespace,
                 env: dict[str, str]) -> list[tuple[float, Sample]]:
    """Send the waves and scrape /metrics every second; `worker stats` runs mid-wave."""
    load = threading.Thread(target=run_load, args=(redis_url, texts, args.waves, args.pause))
    started = time.monotonic()
    scrapes: list[tuple[float, Sample]] = []
    load.start()
    stats = threading.Timer(LEAD_IN_S + 0.5, subprocess.run, args=(
        [sys.executable, "-m", "worker", "stats", "--interval", "2"],),
        kwargs={"env": {**env, "COLUMNS": "100"}, "cwd": ROOT, "check": False})
    stats.start()  # mid-wave, without holding up the scrapes
    duration = LEAD_IN_S + args.waves * args.pause + args.tail
    while load.is_alive() or time.monotonic() - started < duration:
        scrapes.append((time.monotonic() - started, scrape(f"{base}/metrics")))
        time.sleep(1.0)
    load.join()
    stats.join()
    return scrapes


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--texts", type=int, default=400, help="sentences per wave")
    parser.add_argument("--pause", type=float, default=15.0)
    parser.add_argument("--tail", type=float, default=10.0, help="seconds scraped after load")
    args = parser.parse_args()
    texts = (ROOT / "examples" / "sentences.txt").read_text().splitlines()[:args.texts]
    port = free_port()
    with tempfile.TemporaryDirectory() as data, RedisServer(Path(data)) as redis_server:
        env = {**os.environ, "REDBATCH_REDIS_URL": redis_server.url, "REDBATCH_MODEL": "minilm",
               "REDBATCH_METRICS_PORT": str(port), "REDBATCH_DEVICE": "cpu",
               "REDBATCH_LOG_LEVEL": "warning"}
        worker = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, cwd=ROOT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_ready(worker, base)
            scrapes = scrape_waves(base, redis_server.url, texts, args, env)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    draw(scrapes, args.out)
    print(f"wrote {args.out} from {len(scrapes)} scrapes")
    print(summary(scrapes, args.waves * len(texts)))
    return 0


def summary(scrapes: list[tuple[float, Sample]], sent: int) -> str:
    """What the run measured, so a run that lost its load (or its scrapes) shows it."""
    answered = total(scrapes[-1][1], "redbatch_requests_total", status="ok")
    peak = max(rates(scrapes)[1]["throughput"], default=0.0)
    return f"answered {answered:.0f} of {sent} requests; peak {peak:.1f} replies/s"


def rates(scrapes: list[tuple[float, Sample]]) -> tuple[list[float], dict[str, list[float]]]:
    """The panels' series, each point over a window of scrapes (the dashboard's formulas)."""
    window = 5  # scrapes (seconds) per rate, like $__rate_interval
    times: list[float] = []
    series: dict[str, list[float]] = defaultdict(list)
    for i in range(window, len(scrapes)):
        (t0, old), (t1, new) = scrapes[i - window], scrapes[i]
        dt = t1 - t0
        times.append(t1)
        ok = total(new, "redbatch_requests_total", status="ok") - total(
            old, "redbatch_requests_total", status="ok")
        series["throughput"].append(ok / dt)
        for q in (0.5, 0.95, 0.99):
            series[f"e2e p{int(q * 100)}"].append(quantile(q, old, new, "redbatch_request_seconds"))
        series["queue wait p95"].append(quantile(0.95, old, new, "redbatch_queue_wait_seconds"))
        series["compute p95"].append(quantile(0.95, old, new, "redbatch_compute_seconds"))
        new_sum = by_label(new, "redbatch_batch_size_sum", "bucket")
        old_sum = by_label(old, "redbatch_batch_size_sum", "bucket")
        new_count = by_label(new, "redbatch_batch_size_count", "bucket")
        old_count = by_label(old, "redbatch_batch_size_count", "bucket")
        for bucket in new_sum:
            n = new_count[bucket] - old_count.get(bucket, 0.0)
            series[f"batch bucket {bucket}"].append(
                (new_sum[bucket] - old_sum.get(bucket, 0.0)) / n if n else math.nan)
        real = total(new, "redbatch_real_tokens_total") - total(old, "redbatch_real_tokens_total")
        padded = total(new, "redbatch_padded_tokens_total") - total(
            old, "redbatch_padded_tokens_total")
        series["padding efficiency"].append(real / padded if padded else math.nan)
        for name, label in (("redbatch_backlog", "backlog"), ("redbatch_group_lag", "lag"),
                            ("redbatch_pending_entries", "pending"),
                            ("redbatch_queue_depth", "in batcher")):
            series[label].append(total(new, name))
        series["RSS"].append(total(new, "process_resident_memory_bytes") / 2**20)
        for kind, value in by_label(new, "redbatch_memory_bytes", "kind").items():
            series[f"governor: {kind}"].append(value / 2**20)
    return times, series


def draw(scrapes: list[tuple[float, Sample]], out: Path) -> None:
    times, series = rates(scrapes)
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
    panels = [
        ("Throughput (replies/s)", ["throughput"], ""),
        ("Latency percentiles (s)", ["e2e p50", "e2e p95", "e2e p99", "queue wait p95",
                                     "compute p95"], "log"),
        ("Batch size by bucket (mean)", sorted(k for k in series if k.startswith("batch ")), ""),
        ("Padding efficiency (real / padded tokens)", ["padding efficiency"], ""),
        ("Backlog (requests)", ["backlog", "lag", "pending", "in batcher"], ""),
        ("Memory (MiB)", ["RSS", *sorted(k for k in series if k.startswith("governor"))],
         "log"),
    ]
    for ax, (title, keys, scale) in zip(axes.flat, panels, strict=True):
        for key in keys:
            values = series[key]
            ax.plot(times[-len(values):], values, label=key, linewidth=1.3)
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        if scale:
            ax.set_yscale(scale)
        if len(keys) > 1:
            ax.legend(fontsize=8, loc="upper right")
    axes[1][1].set_ylim(0, 1.05)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the load started")
    fig.suptitle("redbatch dashboard: one MiniLM worker on a shared 2-core CPU, "
                 "waves of sample sentences", fontsize=13)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
