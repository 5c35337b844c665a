"""`python -m bench.batches`: a batch job through the Batch API against the same lines
through `python -m producer`, on one Redis and one worker process, in one run.

- overhead: N embeddings lines (stdlib docstring paragraphs), each path in turn
  (`--repeats`, the order alternating): lines/s from submission to the last result (the
  batch path: from POST /v1/batches to `completed`, the upload apart), peak RSS and CPU
  seconds of gateway, worker and producer, the worker's batches; the median of the
  repeats' batch / producer ratios.
- latency beside a batch: single-text online calls at Poisson times, at `--load` times the
  online path's capacity (32 callers back to back for 5 s), for `--online-s` seconds,
  alone and beside a batch of N lines (the order alternating), `--latency-rounds` times:
  the ratio of the p99s of all rounds' calls pooled, each round's p99s, and the lines the
  batch did meanwhile.

Writes bench/results/batches/<machine>.json (with `--out`) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.batches.usage import PeakRss, batch_shape
from bench.common.corpus import build_corpus
from bench.common.load import poisson_offsets
from bench.common.machine import describe_machine
from bench.common.processes import REPO_ROOT, Workers, scrape
from bench.common.stats import median, percentile
from bench.gateway.compare import start_gateway
from worker.streams.server import RedisServer

STREAM = "redbatch:requests:minilm"


def batch_lines(texts: list[str]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "minilm", "input": t}}).encode() + b"\n"
                    for i, t in enumerate(texts))


def via_producer(redis_url: str, texts: list[str], tmp: Path, pids: dict[str, int]
                 ) -> dict[str, Any]:
    source, out = tmp / "producer-in.jsonl", tmp / "producer-out.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "producer", "--no-progress", "--redis-url",
                                redis_url, "--model", "minilm", str(source), "-o", str(out)],
                               cwd=REPO_ROOT, stderr=subprocess.DEVNULL)
    with PeakRss({**pids, "producer": process.pid}) as rss:
        assert process.wait() == 0, "python -m producer failed"
    seconds = time.perf_counter() - started
    assert len(out.read_text().splitlines()) == len(texts)
    return {"lines_per_s": len(texts) / seconds, "seconds": seconds, "peak_rss_mib": rss.mib(),
            "cpu_s": rss.cpu_s()}


def via_batch_api(base_url: str, texts: list[str], pids: dict[str, int]) -> dict[str, Any]:
    # one client: a new one per poll builds a TLS context each time, whose CPU (on two
    # cores, beside the worker) cost the batch path 4-10 % of its time
    with PeakRss(pids) as rss, httpx.Client(base_url=base_url, timeout=300) as client:
        up = time.perf_counter()
        file_id = client.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", io.BytesIO(batch_lines(texts)))}
                              ).json()["id"]
        started = time.perf_counter()
        batch = client.post("/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/embeddings",
            "completion_window": "24h"}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.05)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        seconds = time.perf_counter() - started
    assert batch["request_counts"]["completed"] == len(texts), batch
    return {"lines_per_s": len(texts) / seconds, "seconds": seconds,
            "upload_s": started - up, "peak_rss_mib": rss.mib(), "cpu_s": rss.cpu_s(),
            "batch": batch["id"]}


async def online(base_url: str, texts: list[str], rate: float, seconds: float
                 ) -> tuple[dict[str, Any], list[float]]:
    """Single-text calls at Poisson times: their p50/p99 and failures, and the latencies."""
    latencies: list[float] = []
    failed = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=256)) as client:
        async def call(index: int) -> None:
            nonlocal failed
            begun = time.perf_counter()
            try:
                answer = await client.post("/v1/embeddings", json={
                    "model": "minilm", "input": texts[index % len(texts)]})
            except httpx.HTTPError:  # counted: a connection the gateway dropped is a failure
                failed += 1
                return
            if answer.status_code != 200:
                failed += 1
                return
            latencies.append(time.perf_counter() - begun)

        start, tasks = time.perf_counter(), []
        for index, offset in enumerate(poisson_offsets(rate, seconds, seed=1)):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(call(index)))
        await asyncio.gather(*tasks)
    return {"calls": len(tasks), "failed": failed, "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000}, latencies


async def online_capacity(base_url: str, texts: list[str], seconds: float = 5.0,
                          clients: int = 32) -> float:
    """Single-text calls/s the gateway and worker answer at saturation (`clients` calling
    back to back): the online path's capacity, which the online load is a fraction of (a
    call costs the gateway more than a producer's line, so the producer's rate overstates it)."""
    answered = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=clients)) as client:
        async def caller(index: int, until: float) -> None:
            nonlocal answered
            while time.perf_counter() < until:
                answer = await client.post("/v1/embeddings", json={
                    "model": "minilm", "input": texts[index % len(texts)]})
                answered += answer.status_code == 200
                index += clients

        until = time.perf_counter() + seconds
        await asyncio.gather(*(caller(i, until) for i in range(clients)))
    return answered / seconds


def latency_beside_a_batch(redis_url: str, base_url: str, texts: list[str], rate: float,
                           seconds: float, rounds: int) -> dict[str, Any]:
    """`rounds` pairs of online phases, alone and beside a new batch (cancelled after), the
    order alternating so that the machine's drift falls on both. The ratio is of the p99s
    of all rounds' calls pooled: a round's p99 rests on its slowest 1 % (~20 calls), so it
    swings more between rounds than the 10 % the goal asks about."""
    pooled: dict[str, list[float]] = {"alone": [], "beside_batch": []}
    pairs = []
    for index in range(rounds):
        pair, latencies = one_round(redis_url, base_url, texts, rate, seconds,
                                    beside_first=index % 2 == 1)
        pairs.append(pair)
        for phase, values in latencies.items():
            pooled[phase].extend(values)
    p99 = {phase: percentile(values, 99) * 1000 for phase, values in pooled.items()}
    ratios = [p["p99_ratio"] for p in pairs if p["p99_ratio"] is not None]
    return {"online_rate_per_s": rate, "rounds": pairs, "pooled_p99_ms": p99,
            "pooled_p50_ms": {phase: percentile(values, 50) * 1000
                              for phase, values in pooled.items()},
            "p99_ratio": p99["beside_batch"] / p99["alone"] if p99["alone"] else None,
            "median_round_p99_ratio": median(ratios) if ratios else None,
            "batch_lines_per_s": median([p["batch_lines_per_s"] for p in pairs])}


def drain(redis_url: str, timeout_s: float = 60.0) -> None:
    """Until the model's stream holds no unacked entry (a cancelled batch's lines queued)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            g["pending"] + (g.get("lag") or 0) for g in client.xinfo_groups(STREAM)):
        time.sleep(0.1)
    client.close()


def beside_a_batch(redis_url: str, base_url: str, texts: list[str], rate: float,
                   seconds: float) -> tuple[dict[str, Any], list[float], int]:
    """The online load beside a new batch, which is cancelled and drained after: the
    load's summary and latencies, and the lines the batch did meanwhile."""
    file_id = httpx.post(f"{base_url}/v1/files", data={"purpose": "batch"}, timeout=300,
                         files={"file": ("in.jsonl", io.BytesIO(batch_lines(texts)))}
                         ).json()["id"]
    batch_id = httpx.post(f"{base_url}/v1/batches", json={
        "input_file_id": file_id, "endpoint": "/v1/embeddings",
        "completion_window": "24h"}).json()["id"]
    beside, latencies = asyncio.run(online(base_url, texts, rate, seconds))
    batch = httpx.get(f"{base_url}/v1/batches/{batch_id}").json()
    httpx.post(f"{base_url}/v1/batches/{batch_id}/cancel")
    while httpx.get(f"{base_url}/v1/batches/{batch_id}").json()["status"] == "cancelling":
        time.sleep(0.1)
    drain(redis_url)  # its lines still queued run out before the next alone phase
    counts = batch["request_counts"]
    return beside, latencies, counts["completed"] + counts["failed"]


def one_round(redis_url: str, base_url: str, texts: list[str], rate: float, seconds: float,
              beside_first: bool = False) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Alone and beside a batch, in the order asked: the round's summary, each phase's latencies."""
    def run_alone() -> tuple[dict[str, Any], list[float], int]:
        return (*asyncio.run(online(base_url, texts, rate, seconds)), 0)

    def run_beside() -> tuple[dict[str, Any], list[float], int]:
        return beside_a_batch(redis_url, base_url, texts, rate, seconds)

    phases = [("beside_batch", run_beside), ("alone", run_alone)]
    ran = {name: phase() for name, phase in (phases if beside_first else phases[::-1])}
    (alone, alone_latencies, _), (beside, beside_latencies, done) = \
        ran["alone"], ran["beside_batch"]
    return {"alone": alone, "beside_batch": beside, "beside_first": beside_first,
            "p99_ratio": beside["p99_ms"] / alone["p99_ms"] if alone["p99_ms"] else None,
            "batch_lines_done_meanwhile": done, "batch_lines_per_s": done / seconds
            }, {"alone": alone_latencies, "beside_batch": beside_latencies}


@contextmanager
def stack(tmp: Path, separate_runner: bool
          ) -> Iterator[tuple[str, str, dict[str, int], list[int]]]:
    """An embedded Redis, one minilm worker process and a gateway (with `separate_runner`,
    one with no batch runner, and `python -m producer batches` beside it)."""
    server = RedisServer(tmp / "redis", appendonly=False).start()
    os.environ["REDBATCH_BATCH_RUNNER"] = "false" if separate_runner else "true"
    extra: list[subprocess.Popen[bytes]] = []
    try:
        with Workers(server.url, "redbatch", 1, tmp, model="minilm") as workers:
            workers.wait_until_reading()
            gateway, base_url = start_gateway(server.url, 1, tmp / "gateway.log")
            pids = {"gateway": gateway.pid, "worker": workers.processes[0].pid}
            if server.process is not None:  # Redis's CPU: the batch path's scripts run there
                pids["redis"] = server.process.pid
            if separate_runner:
                extra.append(subprocess.Popen(
                    [sys.executable, "-m", "producer", "batches", "--redis-url", server.url],
                    cwd=REPO_ROOT, stderr=subprocess.DEVNULL))
                pids["runner"] = extra[0].pid
            try:
                yield server.url, base_url, pids, workers.ports
            finally:
                for process in [gateway, *extra]:
                    process.terminate()
                    process.wait(30)
    finally:
        server.stop()


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    texts = build_corpus(args.lines).texts
    texts = (texts * (args.lines // max(len(texts), 1) + 1))[:args.lines]
    runs: dict[str, list[dict[str, Any]]] = {"producer": [], "batch_api": []}
    with stack(tmp, args.separate_runner) as (redis_url, base_url, pids, ports):
        for repeat in range(args.repeats):
            order = ("producer", "batch_api") if repeat % 2 == 0 else ("batch_api", "producer")
            for path in order:
                before = scrape(ports)
                run = (via_producer(redis_url, texts, tmp, pids) if path == "producer"
                       else via_batch_api(base_url, texts, pids))
                runs[path].append({**run, "worker_batches": batch_shape(before, scrape(ports))})
        ratios = [b["lines_per_s"] / p["lines_per_s"]
                  for b, p in zip(runs["batch_api"], runs["producer"], strict=True)]
        capacity = asyncio.run(online_capacity(base_url, texts, args.capacity_s))
        rate = capacity * args.load
        latency = latency_beside_a_batch(redis_url, base_url, texts, rate, args.online_s,
                                         args.latency_rounds) if args.latency_rounds else None
    return {"machine": describe_machine(), "lines": args.lines, "runs": runs,
            "median_lines_per_s": {p: median([r["lines_per_s"] for r in rs])
                                   for p, rs in runs.items()},
            "batch_over_producer": median(ratios), "ratios": ratios,
            "online_capacity_per_s": capacity, "latency": latency,
            "separate_runner": args.separate_runner,
            # settings given to the worker and gateway through the environment (a sweep's)
            "settings_env": {k: v for k, v in os.environ.items() if k.startswith("REDBATCH_")
                             and k != "REDBATCH_BATCH_RUNNER"},
            "command": " ".join(["python -m bench.batches", *sys.argv[1:]])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batches", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--online-s", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=0.5, help="online rate / capacity")
    parser.add_argument("--capacity-s", type=float, default=5.0, help=(
        "seconds of saturation that measure the online path's capacity"))
    parser.add_argument("--latency-rounds", type=int, default=2, help=(
        "pairs of online phases, alone then beside a batch (0: throughput only)"))
    parser.add_argument("--separate-runner", action="store_true", help=(
        "the batch runner as `python -m producer batches`, not in the gateway's process"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(args, Path(tmp))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0
