"""`python -m bench.gateway`: embeddings through the OpenAI-compatible gateway against the
direct Redis protocol, on the same corpus, worker and Redis, in one run.

The load comes from one separate load-generator process (asyncio, one event loop), with the
same design for both paths: `producer.AsyncClient` (submit_many on a shared reply key, then
BLPOP/LPOP) for the direct path, a minimal keep-alive HTTP/1.1 client (`HttpPool`, or
`--http-client httpx`) for the gateway. Connections are opened before each timed run. Two
figures, each the median of interleaved repeats (the order of the paths alternates):

- throughput at saturation: the corpus in calls of `--batch` texts, `--clients` calls in
  flight (closed loop); reported as the median of the repeats' gateway / direct ratios.
- p50 latency added at half load: single-text calls at Poisson times (open loop) at one rate
  for both paths, half of what the direct path sustains for single-text calls with the same
  load generator (`--clients` calls in flight, median of the capacity runs); reported as the
  median of the repeats' gateway p50 - direct p50.

Beside them, the gateway processes' CPU time per text (saturation) and per call (half load):
on a machine shared with other jobs it moves much less than the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common.corpus import build_corpus
from bench.common.load import poisson_offsets
from bench.common.processes import REPO_ROOT, Workers
from bench.common.stats import median, percentile
from bench.gateway.http_pool import HttpPool
from producer import AsyncClient, protocol
from producer.request_base import block_slices
from worker.streams.server import RedisServer, free_port

Call = Callable[[list[str]], Awaitable[int]]  # embeds the texts; returns how many came back
PATHS = ("direct", "gateway")


async def collect(client: AsyncClient, reply_to: str, count: int,
                  timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """`count` envelopes from a shared reply key: BLPOP for the first, LPOP for the rest."""
    found: list[bytes] = []
    for block_s in block_slices(timeout_s):
        popped: Any = await client.redis.blpop([reply_to], timeout=block_s)
        if popped is None:
            continue
        more = count - len(found) - 1
        found += [popped[1], *((await client.redis.lpop(reply_to, more) or []) if more else [])]
        if len(found) >= count:
            break
    return [protocol.decode_envelope(data) for data in found]


@asynccontextmanager
async def direct_target(redis_url: str) -> AsyncIterator[Call]:
    """The direct protocol through one AsyncClient (one connection pool)."""
    client = AsyncClient(redis_url, "minilm")

    async def call(texts: list[str]) -> int:
        reply_to = client.new_reply_key()
        ids = await client.submit_many([{"text": t} for t in texts], reply_to=reply_to)
        envelopes = await collect(client, reply_to, len(ids))
        assert len(envelopes) == len(ids) and all(e["ok"] for e in envelopes)
        return len(envelopes)
    try:
        yield call
    finally:
        await client.close()


@asynccontextmanager
async def gateway_target(base_url: str, http_client: str = "raw") -> AsyncIterator[Call]:
    """POST /v1/embeddings over keep-alive connections: HttpPool, or one httpx.AsyncClient."""
    if http_client == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
            async def call_httpx(texts: list[str]) -> int:
                response = await http.post("/v1/embeddings",
                                           json={"model": "minilm", "input": texts})
                response.raise_for_status()
                return len(response.json()["data"])
            yield call_httpx
        return
    pool = HttpPool(base_url)

    async def call(texts: list[str]) -> int:
        body = json.dumps({"model": "minilm", "input": texts}).encode()
        return len(json.loads(await pool.post("/v1/embeddings", body))["data"])
    try:
        yield call
    finally:
        pool.close()


async def saturation(call: Call, texts: Sequence[str], batch: int, clients: int) -> float:
    """Texts per second with `clients` calls of `batch` texts in flight (closed loop)."""
    chunks = iter([list(texts[i:i + batch]) for i in range(0, len(texts), batch)])

    async def loop() -> int:
        return sum([await call(chunk) for chunk in chunks])
    started = time.perf_counter()
    done = sum(await asyncio.gather(*(loop() for _ in range(clients))))
    assert done == len(texts)
    return done / (time.perf_counter() - started)


async def open_loop_p50(call: Call, texts: Sequence[str], rate: float, duration_s: float,
                        seed: int) -> float:
    """p50 seconds of single-text calls arriving at Poisson times (open loop)."""
    latencies: list[float] = []

    async def one(index: int) -> None:
        started = time.perf_counter()
        await call([texts[index % len(texts)]])
        latencies.append(time.perf_counter() - started)

    tasks = []
    start = time.perf_counter()
    for index, offset in enumerate(poisson_offsets(rate, duration_s, seed)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    await asyncio.gather(*tasks)
    return percentile(latencies, 50)


async def _drive(path: str, address: str, job: str, texts: list[str], spec: tuple[Any, ...],
                 clients: int, http_client: str) -> float:
    target = (direct_target(address) if path == "direct"
              else gateway_target(address, http_client))
    async with target as call:
        await saturation(call, texts[:2 * clients], 1, clients)  # open the connections
        if job == "saturation":
            return await saturation(call, texts, *spec)
        return await open_loop_p50(call, texts, *spec)


def drive(path: str, address: str, job: str, texts: list[str], spec: tuple[Any, ...],
          clients: int, http_client: str = "raw") -> float:
    """One measurement in the load-generator process: a texts/s rate or a p50 in seconds."""
    return asyncio.run(_drive(path, address, job, texts, spec, clients, http_client))


def start_gateway(redis_url: str, processes: int, log: Path) -> tuple[subprocess.Popen[bytes],
                                                                      str]:
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "producer", "serve", "--redis-url", redis_url, "--host",
             "127.0.0.1", "--port", str(port), "--processes", str(processes), "--log-level",
             "warning", "--max-inputs", "4096", "--request-timeout-s", "120"], cwd=REPO_ROOT,
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200:
                return process, base_url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the gateway did not start:\n" + log.read_text()[-2000:])


class GatewayCpu:
    """CPU seconds the gateway's processes (uvicorn's and its workers') spend per text."""

    def __init__(self, pid: int, warmup_texts: int) -> None:
        self.process = psutil.Process(pid)
        self.warmup_texts = warmup_texts  # each run's _drive opens its connections first
        self.per_text: dict[str, list[float]] = {"saturation": [], "open": []}

    def seconds(self) -> float:
        total = 0.0
        for process in [self.process, *self.process.children(recursive=True)]:
            with suppress(psutil.NoSuchProcess):
                total += sum(process.cpu_times()[:2])  # user + system
        return total

    def record(self, kind: str, texts: int, since: float) -> None:
        self.per_text[kind].append((self.seconds() - since) / (texts + self.warmup_texts))


def measure(args: argparse.Namespace, texts: list[str], addresses: dict[str, str],
            generator: ProcessPoolExecutor, cpu: GatewayCpu) -> dict[str, Any]:
    """Every figure, from interleaved repeats; see the module docstring."""
    def job(path: str, kind: str, *spec: Any) -> float:
        since = cpu.seconds()
        found: float = generator.submit(drive, path, addresses[path], kind, texts, spec,
                                        args.clients, args.http_client).result()
        if path == "gateway" and (kind == "open" or spec[0] == args.batch):
            cpu.record(kind, len(poisson_offsets(*spec) if kind == "open" else texts), since)
        return found

    def orders() -> list[tuple[str, ...]]:
        return [PATHS if repeat % 2 == 0 else PATHS[::-1] for repeat in range(args.repeats)]

    for path in PATHS:  # warm both paths (the worker's model, the gateway's caches)
        job(path, "saturation", args.batch, args.clients)
    cpu.per_text["saturation"].clear()  # the warm-up's first calls are not the steady state
    rates: dict[str, list[float]] = {p: [] for p in PATHS}
    single: dict[str, list[float]] = {p: [] for p in PATHS}
    for order in orders():
        for path in order:
            rates[path].append(job(path, "saturation", args.batch, args.clients))
        for path in order:
            single[path].append(job(path, "saturation", 1, args.clients))
    half = median(single["direct"]) / 2
    p50s: dict[str, list[float]] = {p: [] for p in PATHS}
    for repeat, order in enumerate(orders()):
        for path in order:
            p50s[path].append(job(path, "open", half, args.duration, repeat))
    return {"rates": rates, "single_text_rates": single, "half_rate": half, "p50s": p50s,
            "ratio": median([g / d for g, d in zip(rates["gateway"], rates["direct"],
                                                   strict=True)]),
            "added_p50_ms": median([(g - d) * 1000 for g, d in zip(
                p50s["gateway"], p50s["direct"], strict=True)]),
            "gateway_cpu_ms_per_text": {kind: median(values) * 1000
                                        for kind, values in cpu.per_text.items()}}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    texts = build_corpus(args.corpus).texts
    spawn = multiprocessing.get_context("spawn")
    with RedisServer(tmp / "redis") as server, \
            Workers(server.url, "redbatch", 1, tmp, model="minilm") as workers, \
            ProcessPoolExecutor(1, mp_context=spawn) as generator:
        workers.wait_until_reading()
        gateway, base_url = start_gateway(server.url, args.processes, tmp / "gateway.log")
        try:
            found = measure(args, texts, {"direct": server.url, "gateway": base_url},
                            generator, GatewayCpu(gateway.pid, 2 * args.clients))
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
    return {"texts": len(texts), "batch": args.batch, "clients": args.clients,
            "processes": args.processes, "repeats": args.repeats,
            "http_client": args.http_client, **found}


def report(found: dict[str, Any]) -> None:
    rates, single, p50s = found["rates"], found["single_text_rates"], found["p50s"]
    print(f"{found['texts']} texts, {found['batch']} per call, {found['clients']} calls in "
          f"flight, {found['processes']} gateway process(es), {found['repeats']} interleaved "
          "repeats, one asyncio load-generator process (HTTP client: "
          f"{found['http_client']})")
    print(f"saturation texts/s: direct {median(rates['direct']):.1f}, gateway "
          f"{median(rates['gateway']):.1f} -> gateway/direct {found['ratio']:.3f} "
          f"(median of paired ratios)")
    print(f"single-text calls/s: direct {median(single['direct']):.1f}, gateway "
          f"{median(single['gateway']):.1f}")
    print(f"p50 at half load ({found['half_rate']:.1f} req/s, both paths): direct "
          f"{median(p50s['direct']) * 1000:.2f} ms, gateway {median(p50s['gateway']) * 1000:.2f}"
          f" ms -> added {found['added_p50_ms']:.2f} ms (median of paired differences)")
    cpu = found["gateway_cpu_ms_per_text"]
    print(f"gateway CPU: {cpu['saturation']:.2f} ms per text at saturation, {cpu['open']:.2f}"
          " ms per single-text call at half load (medians)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=int, default=600, help="texts per saturation run")
    parser.add_argument("--batch", type=int, default=16, help="texts per call at saturation")
    parser.add_argument("--clients", type=int, default=8, help="calls in flight at saturation")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per latency run")
    parser.add_argument("--processes", type=int, default=1, help="gateway processes")
    parser.add_argument("--http-client", choices=("raw", "httpx"), default="raw",
                        help="the load generator's HTTP client (raw: bench.gateway.http_pool)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        found = run(args, Path(tmp))
    report(found)
    if args.json:
        args.json.write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
