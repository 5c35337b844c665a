"""Helpers for the tests that break things: worker processes, and counting every reply."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis

from producer.protocol import decode_envelope
from tests.rigs.paths import REPO_ROOT
from worker.streams.server import free_port

ROOT = REPO_ROOT
CLAIM_IDLE_MS = 1000
ECHO_FLAGS = ("--model", "echo", "--model-options", '{"delay_ms": 5}', "--max-batch-size", "16",
              "--max-inflight", "64", "--read-count", "32", "--claim-idle-ms", str(CLAIM_IDLE_MS),
              "--block-ms", "200", "--maintenance-interval-s", "0.5")


class WorkerProcess:
    """`python -m worker ...` in a child process, logging JSON lines to a file."""

    def __init__(self, url: str, log: Path, *flags: str) -> None:
        self.log = log
        command = [sys.executable, "-m", "worker", "run", "--redis-url", url,
                   "--metrics-port", "0", "--device", "cpu", "--log-format", "json", *flags]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                            stderr=out, env={**os.environ, "PYTHONPATH": str(ROOT)})

    @property
    def pid(self) -> int:
        return self.process.pid

    def logged(self, event: str) -> bool:
        return f'"event": "{event}"' in self.log.read_text(errors="replace")

    def wait_serving(self, timeout: float = 90) -> WorkerProcess:
        wait_until(lambda: self.logged("worker.serving") or self.process.poll() is not None,
                   timeout, "worker start")
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        return self

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)


class GatewayProcess:
    """`python -m producer serve` in a child process: its batch runner holds a batch under a
    1 s lease, so a new gateway takes it over soon after this one is killed."""

    def __init__(self, url: str, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "producer", "serve", "--redis-url", url, "--port",
                 str(self.port), "--batch-lease-s", "1", "--batch-window", "128",
                 # lines a killed gateway recorded and never queued go again after 3 s
                 "--batch-takeover-s", "3",
                 "--batch-max-backlog", "128", "--log-level", "warning", *flags],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out)
        try:
            wait_until(self.ready, 30, "gateway start")
        except BaseException:
            self.kill()  # not left running past a failed start
            raise

    def ready(self) -> bool:
        assert self.process.poll() is None, "the gateway exited"
        try:
            return httpx.get(f"{self.base}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


def batch(base: str, batch_id: str) -> dict[str, Any]:
    """GET /v1/batches/<id> of the gateway at `base`."""
    found: dict[str, Any] = httpx.get(f"{base}/v1/batches/{batch_id}", timeout=5).json()
    return found


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Replies:
    """Every envelope arriving on one shared reply key, counted per request id."""

    def __init__(self, url: str, reply_key: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.reply_key = reply_key
        self.counts: Counter[str] = Counter()
        self.envelopes: dict[str, dict[str, Any]] = {}
        self.arrived_at: dict[str, float] = {}

    def poll(self) -> int:
        """Take what has arrived; survives Redis being down. Returns how many came."""
        try:
            raw = cast(list[bytes], self.client.lpop(self.reply_key, 1000) or [])
        except (redis.ConnectionError, redis.TimeoutError):
            return 0
        now = time.monotonic()
        for data in raw:
            envelope = decode_envelope(data)
            self.counts[envelope["id"]] += 1
            self.envelopes.setdefault(envelope["id"], envelope)
            self.arrived_at.setdefault(envelope["id"], now)
        return len(raw)

    def wait_for(self, ids: Iterable[str], timeout: float) -> None:
        missing = set(ids)

        def done() -> bool:
            self.poll()
            missing.difference_update(self.counts)
            return not missing

        wait_until(done, timeout, f"replies ({len(missing)} missing)", interval=0.02)

    def linger(self, seconds: float) -> None:
        """Keep counting for a while, so a late second reply would be seen."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(0.05)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.counts.values())


def pending(r: redis.Redis, stream: str, group: str = "workers",
            consumer: str | None = None) -> list[str]:
    """Entry ids pending in the group (for one consumer if given)."""
    rows = r.xpending_range(stream, group, "-", "+", 100_000, consumername=consumer)
    return [cast(bytes, row["message_id"]).decode() for row in rows]


def request_ids(r: redis.Redis, stream: str, entry_ids: Sequence[str]) -> list[str]:
    pipe = r.pipeline(transaction=False)
    for entry_id in entry_ids:
        pipe.xrange(stream, entry_id, entry_id)
    return [found[0][1][b"id"].decode() for found in pipe.execute() if found]


def heaviest_on_redis_7_only(r: redis.Redis) -> None:
    """The slowest scenarios (several process starts each) run once, on Redis 7; their
    version-specific paths (XAUTOCLAIM, AOF, NOGROUP) are covered on 6.2 by the others."""
    from tests.rigs.servers import BINARIES

    if len(BINARIES) > 1 and int(r.info()["redis_version"].split(".")[0]) < 7:
        pytest.skip("heavy scenario: Redis 7 only, to keep the suite short")


def report(scenario: str, **figures: Any) -> None:
    """One line per scenario with its figures, for the closing note (shown with -s)."""
    text = " ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}"
                    for k, v in figures.items())
    print(f"\nRELIABILITY {scenario}: {text}", flush=True)
