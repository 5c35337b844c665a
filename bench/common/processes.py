"""Worker processes for a benchmark configuration, started as a user would start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.common.paths import REPO_ROOT
from bench.common.stats import Samples
from producer import protocol
from worker.streams.server import free_port


def worker_command(redis_url: str, namespace: str, metrics_port: int,
                   settings: dict[str, Any]) -> list[str]:
    """`python -m worker` with every setting as a flag (lists and dicts as JSON)."""
    command = [sys.executable, "-m", "worker", "run", "--redis-url", redis_url,
               "--namespace", namespace, "--metrics-port", str(metrics_port),
               "--metrics-host", "127.0.0.1", "--log-level", "warning"]
    for name, value in {"device": "cpu", **settings}.items():  # a CPU unless told otherwise
        flag = "--" + name.replace("_", "-")
        command += [flag, json.dumps(value) if isinstance(value, list | dict) else str(value)]
    return command


def scrape(ports: Sequence[int]) -> Samples:
    """The /metrics of the worker processes on these ports, summed by name and labels."""
    totals: Samples = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


class Workers:
    """`count` worker processes on one namespace; stopped (SIGTERM) when the block ends.

    Several pools start at once (their imports overlap), then each is waited for.
    """

    def __init__(self, redis_url: str, namespace: str, count: int, log_dir: Path,
                 **settings: Any) -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.settings = {"model": "echo", **settings}
        self.model_name = str(self.settings.get("model_name")
                              or str(self.settings["model"]).rpartition(":")[2].lower())
        self.stream = protocol.stream_key(namespace, self.model_name)
        self.ports = [free_port() for _ in range(count)]
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> Self:
        """Start the processes without waiting for them (see wait_until_reading)."""
        env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}"}
        for index, port in enumerate(self.ports):
            with self.log_path(index).open("wb") as log:
                self.processes.append(subprocess.Popen(
                    worker_command(self.redis_url, self.namespace, port, self.settings),
                    cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        return self

    def __enter__(self) -> Self:
        return self.start()

    def wait_until_reading(self, timeout_s: float = 120.0) -> None:
        """Every process has joined the group and issued its first read."""
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while len(self._consumers(client)) < len(self.processes):
                for index, process in enumerate(self.processes):
                    if process.poll() is not None:
                        raise RuntimeError(f"a worker exited at start ({self.settings}):\n"
                                           + self.log_path(index).read_text()[-2000:])
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not start in time")
                time.sleep(0.05)
        finally:
            client.close()

    def log_path(self, index: int) -> Path:
        return self.log_dir / f"{self.namespace}-{index}.log"

    def _consumers(self, client: redis.Redis) -> list[Any]:
        try:
            return list(client.xinfo_consumers(self.stream, protocol.DEFAULT_GROUP))
        except redis.ResponseError:  # no stream or group yet
            return []

    def metrics(self) -> Samples:
        """Prometheus samples summed over the processes, keyed by name and labels."""
        return scrape(self.ports)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
