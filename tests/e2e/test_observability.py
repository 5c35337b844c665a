"""Metrics, the sampler, /healthz and /readyz, and `python -m worker stats`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from producer import Client, protocol
from tests.rigs.paths import REPO_ROOT
from worker.cli import main
from worker.commands.readiness import Readiness
from worker.commands.sampler import Sampler
from worker.observe.endpoints import start_server
from worker.streams.queue_stats import (
    RateMeter,
    count_undelivered,
    drain_seconds,
    read_stream_stats,
)
from worker.streams.reader import StreamReader

ROOT = REPO_ROOT


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def http() -> Iterator[tuple[str, dict[str, bool]]]:
    """The metrics server on a free port; the test edits the readiness checks it reports."""
    checks: dict[str, bool] = {"model": False}
    server = start_server("127.0.0.1", 0, REGISTRY, lambda: dict(checks))
    yield f"http://127.0.0.1:{server.server_port}", checks
    server.shutdown()
    server.server_close()


# --- pure policy ------------------------------------------------------------------------------


def test_rate_meter_measures_over_a_sliding_window() -> None:
    meter = RateMeter(window_s=10)
    assert meter.rate() is None
    meter.add(0.0, 100)
    assert meter.rate() is None
    meter.add(2.0, 140)
    assert meter.rate() == pytest.approx(20.0)
    for t in range(3, 30):
        meter.add(float(t), 140 + 5 * (t - 2))
    assert meter.rate() == pytest.approx(5.0)  # the early burst has left the window
    meter.add(30.0, 3)  # counter reset (Redis flushed): no negative rate
    assert meter.rate() is None


def test_drain_seconds() -> None:
    assert drain_seconds(0, None) == 0.0
    assert drain_seconds(100, 50.0) == pytest.approx(2.0)
    assert drain_seconds(100, 0.0) == float("inf")


# --- HTTP endpoints ---------------------------------------------------------------------------


def test_healthz_readyz_and_metrics_share_the_port(http: tuple[str, dict[str, bool]]) -> None:
    base, checks = http
    assert get(f"{base}/healthz")[0] == 200
    status, body = get(f"{base}/readyz")
    assert status == 503 and json.loads(body) == {"ready": False,
                                                  "checks": {"model": False}}
    checks["model"] = True
    assert get(f"{base}/readyz")[0] == 200
    status, body = get(f"{base}/metrics")
    assert status == 200 and "redbatch_requests_total" in body


def test_readiness_follows_the_worker_and_redis(redis_url: str, worker_factory: Any) -> None:
    readiness = Readiness()
    assert readiness() == {"model": False, "serving": False, "redis": False}
    with worker_factory() as worker:
        sampler = Sampler(worker, worker.reader.client, interval_s=60)
        readiness.worker, readiness.redis = worker, sampler
        assert readiness()["redis"] is False  # not sampled yet
        sampler.sample()
        assert all(readiness().values())
    assert readiness()["serving"] is False  # stopped


# --- Redis-sampled metrics --------------------------------------------------------------------


def enqueue(r: redis.Redis, model: str, count: int) -> None:
    client = Client(model=model, redis_client=r)
    client.submit_many([{"n": i} for i in range(count)])


@pytest.mark.parametrize("consumed", [0, 3])
def test_lag_and_pending_on_every_redis_version(r: redis.Redis, consumed: int) -> None:
    stream = protocol.stream_key("redbatch", "m")
    reader = StreamReader(r, stream, "workers", "c1")
    reader.ensure_group()
    enqueue(r, "m", 10)
    if consumed:
        reader.draining_own_pending = False
        assert len(reader.read(consumed, 100)) == consumed
    stats = read_stream_stats(r, "redbatch", "m", "workers")
    assert (stats.length, stats.lag, stats.pending, stats.backlog) == (10, 10 - consumed,
                                                                       consumed, 10)
    assert [(c.name, c.pending) for c in stats.consumers] == ([("c1", consumed)]
                                                               if consumed else [])


def test_lag_count_stops_at_the_cap(r: redis.Redis) -> None:
    stream = protocol.stream_key("redbatch", "m")
    StreamReader(r, stream, "workers", "c1").ensure_group()
    enqueue(r, "m", 12)
    counts_one_by_one = int(r.info()["redis_version"].split(".")[0]) < 7  # 7 knows its lag
    assert count_undelivered(r, stream, "workers", pending=0, cap=5) == (
        5 if counts_one_by_one else 12)
    assert count_undelivered(r, stream, "workers", pending=0) == 12


def test_missing_stream_reads_as_empty(r: redis.Redis) -> None:
    stats = read_stream_stats(r, "redbatch", "nothing", "workers")
    assert (stats.length, stats.backlog, stats.answered, stats.consumers) == (0, 0, 0, [])


def test_worker_metrics_after_a_run(redis_url: str, r: redis.Redis, worker_factory: Any) -> None:
    answered_before = sample("redbatch_requests_total", model="echo", status="ok")
    e2e_before = sample("redbatch_request_seconds_count", model="echo")
    with worker_factory(model="echo") as worker:
        client = Client(redis_client=redis.Redis.from_url(redis_url, socket_timeout=30),
                        model="echo")
        reply_to = client.new_reply_key()
        client.submit_many([{"i": i} for i in range(20)], reply_to=reply_to)
        assert len(client.collect(reply_to, 20, timeout=20)) == 20
        sampler = Sampler(worker, r)
        sampler.sample()
        enqueue(r, "echo", 0)
        sampler.sample()
    assert sample("redbatch_requests_total", model="echo", status="ok") - answered_before == 20
    assert sample("redbatch_request_seconds_count", model="echo") - e2e_before == 20
    assert r.get(protocol.answered_key("redbatch", "echo")) == b"20"
    assert sample("redbatch_backlog", model="echo") == 0
    assert sample("redbatch_stream_length", model="echo") == 20  # acked, not trimmed here
    assert sample("redbatch_consumers", model="echo") == 1
    assert sample("redbatch_inflight", model="echo") == 0
    assert sample("redbatch_queue_depth", model="echo", bucket="0") == 0
    assert sample("redbatch_drain_seconds", model="echo") == 0


def test_gauges_combine_across_processes(tmp_path: Path) -> None:
    """Under --processes, each child's gauges land in PROMETHEUS_MULTIPROC_DIR: in-flight
    entries add up, while the stream's state is one value, not a sum."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    child = ("from worker.observe import metrics; import sys; n = int(sys.argv[1]);"
             "metrics.IN_FLIGHT.labels('m').set(n); metrics.STREAM_LENGTH.labels('m').set(50);"
             "metrics.REQUESTS.labels('m', 'ok').inc(n)")
    for n in (3, 4):
        subprocess.run([sys.executable, "-c", child, str(n)], env=env, check=True, timeout=60)
    exposed = subprocess.run(
        [sys.executable, "-c", "from prometheus_client import generate_latest;"
         "from worker.observe import metrics; print(generate_latest(metrics.registry()).decode())"],
        env=env, check=True, timeout=60, capture_output=True, text=True).stdout
    assert 'redbatch_inflight{model="m"} 7.0' in exposed
    assert 'redbatch_stream_length{model="m"} 50.0' in exposed
    assert 'redbatch_requests_total{model="m",status="ok"} 7.0' in exposed


# --- python -m worker stats -------------------------------------------------------------------


@pytest.fixture
def keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() points structlog at capsys's stderr, closed after the test: later workers'
    threads would die writing their logs there."""
    monkeypatch.setattr("worker.cli.configure_logging", lambda *args: None)


@pytest.mark.usefixtures("keep_logging")
def test_stats_json_and_table(redis_url: str, r: redis.Redis, worker_factory: Any,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with worker_factory(model="echo") as worker:
        Client(redis_url, "echo").infer({"x": 1}, timeout=10)
        consumer = worker.settings.consumer
        enqueue(r, "waiting", 4)  # a model without workers yet
        r.xadd(protocol.dead_letter_key("redbatch", "echo"), {"id": "poison"})
        capsys.readouterr()  # the worker's logs
        assert main(["stats", "--redis-url", redis_url, "--json", "--interval", "0.05"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert main(["stats", "--redis-url", redis_url, "--interval", "0.05"]) == 0
        table = capsys.readouterr().out
    by_model = {m["model"]: m for m in report["models"]}
    assert set(by_model) == {"echo", "waiting"}
    echo, waiting = by_model["echo"], by_model["waiting"]
    assert (echo["answered"], echo["backlog"], echo["dead_letters"]) == (1, 0, 1)
    assert [(c["name"], c["live"]) for c in echo["consumers"]] == [(consumer, True)]
    assert echo["consumers"][0]["layout"] == worker.layout.describe()  # announced at start
    assert echo["throughput_per_s"] == 0 and echo["drain_seconds"] == 0
    assert (waiting["length"], waiting["backlog"], waiting["drain_seconds"]) == (4, 4, None)
    assert "waiting" in table and "echo" in table and "consumers" in table
    assert "instance(s)" in table and "live " in table
    capsys.readouterr()
    assert main(["stats", "--redis-url", redis_url, "--json", "--interval", "0"]) == 0
    after = {m["model"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert after["echo"]["consumers"] == []  # a clean stop leaves the group


@pytest.mark.usefixtures("keep_logging")
def test_stats_explains_a_missing_or_unreachable_redis(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDBATCH_REDIS_URL", raising=False)
    assert main(["stats", "--json"]) == 2
    assert "REDBATCH_REDIS_URL" in capsys.readouterr().err
    assert main(["stats", "--redis-url", "redis://127.0.0.1:1/0", "--interval", "0"]) == 2
    assert "cannot read stats" in capsys.readouterr().err


@pytest.mark.usefixtures("keep_logging")  # main() points the logs at capsys's stderr
def test_stats_says_when_a_model_asked_for_has_no_stream(
        redis_url: str, r: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    r.xgroup_create("redbatch:requests:present", "workers", id="0", mkstream=True)
    assert main(["stats", "--redis-url", redis_url, "--interval", "0", "--json",
                 "--models", "present", "nosuch"]) == 0
    err = capsys.readouterr().err
    assert "no request stream for model 'nosuch'" in err and "'present'" not in err


def test_observe_all_counts_exactly_as_observe_does() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    from worker.observe.metrics import LATENCY_BUCKETS, observe_all

    registry = CollectorRegistry()
    one = Histogram("one_by_one", "", ["m"], buckets=LATENCY_BUCKETS, registry=registry)
    bulk = Histogram("all_at_once", "", ["m"], buckets=LATENCY_BUCKETS, registry=registry)
    values = [0.0, 0.001, 0.0011, 0.3, 0.5, 0.5, 59.9, 60.0, 61.0, 1e9]  # on, between, above
    for value in values:
        one.labels("x").observe(value)
    observe_all(bulk.labels("x"), values)
    observe_all(bulk.labels("x"), [])

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        family = next(f for f in registry.collect() if f.name == name)
        return [(s.name.removeprefix(name), s.labels, s.value) for s in family.samples
                if not s.name.endswith("_created")]

    assert samples("one_by_one") == samples("all_at_once")
    assert ("_count", {"m": "x"}, 10.0) in samples("all_at_once")


def test_the_stats_tables_show_every_value_in_80_columns() -> None:
    """Long texts wrap rather than cut (or squeeze a column to nothing)."""
    from rich.console import Console

    from worker.commands.stats import render
    from worker.streams.queue_stats import ConsumerStats, StreamStats

    latency = {"target_ms": 250.0, "observed_ms": 182.0, "percentile": 0.99, "margin_ms": 10.0}
    consumer = ConsumerStats("redbatch-worker-5d8f7c9b6-x2k4p", 3, 1200,
                             "2 instance(s) x 1 thread(s)", latency, None,
                             int(time.time() * 1000) - 1200, True)
    stats = StreamStats("minilm", 12345, 1000, 12, 99999, 3, [consumer])
    for width in (80, 200):  # at 200, nothing wraps
        console = Console(width=width, record=True)
        console.print(render([(stats, 123.4)], "redbatch"))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
        for value in ("12345", "1012", "123.4", "8 s", "live 1 s"):
            assert f" {value} " in text, (width, value)
    for value in ("redbatch-worker-5d8f7c9b6-x2k4p", "2 instance(s) x 1 thread(s)",
                  "p99 182 of 250 ms, margin 10 ms"):
        assert value in text, value
