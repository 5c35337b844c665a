"""Issue 33: `stats` tells live from dead, a clean stop leaves the group, progress lines,
warm-up lines, no progress bars in JSON logs, a hint for a taken metrics port."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from producer import protocol
from worker.observe.progress import ProgressLog, Totals, progress_fields
from worker.observe.startup import QUIET_BARS, logged_step, quiet_progress_bars
from worker.streams.queue_stats import read_stream_stats
from worker.streams.reclaimer import Reclaimer

STREAM, GROUP = protocol.stream_key("redbatch", "echo"), "workers"


def test_a_clean_stop_removes_the_consumer_and_its_announcement(
        r: redis.Redis, worker_factory: Any) -> None:
    with worker_factory(model="echo") as worker:
        consumer = worker.settings.consumer
        stats = read_stream_stats(r, "redbatch", "echo", GROUP)
        assert [(c.name, c.live) for c in stats.consumers] == [(consumer, True)]
    assert [c["name"] for c in r.xinfo_consumers(STREAM, GROUP)] == []
    assert r.hget("redbatch:workers:echo", consumer) is None


def test_leaving_with_entries_held_keeps_the_consumer_and_its_announcement(
        r: redis.Redis) -> None:
    """A worker stopping with entries unanswered (the grace ran out, a thread failed): its
    consumer stays (DELCONSUMER would drop the entries), and so does its announcement."""
    from worker.streams.maintenance import Maintenance

    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r.xadd(STREAM, {"payload": "x"})
    r.xreadgroup(GROUP, "holder", {STREAM: ">"}, count=1)
    workers = "redbatch:workers:echo"
    maintenance = Maintenance(r, STREAM, GROUP, "echo",
                              Reclaimer(r, STREAM, GROUP, "holder", 30_000, "echo"), 5.0,
                              3_600_000, workers_key=workers)
    maintenance.announce()
    assert maintenance.leave() is False
    assert r.hexists(workers, "holder") and r.xpending(STREAM, GROUP)["pending"] == 1
    r.xack(STREAM, GROUP, r.xpending(STREAM, GROUP)["min"])
    assert maintenance.leave() is True
    assert not r.hexists(workers, "holder") and r.xinfo_consumers(STREAM, GROUP) == []


def test_a_consumer_holding_entries_stays_on_release(r: redis.Redis) -> None:
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r.xadd(STREAM, {"payload": "x"})
    r.xreadgroup(GROUP, "holder", {STREAM: ">"}, count=1)
    assert Reclaimer(r, STREAM, GROUP, "holder", 30_000, "echo").release() is False
    assert [c["name"] for c in r.xinfo_consumers(STREAM, GROUP)] == [b"holder"]
    assert r.xpending(STREAM, GROUP)["pending"] == 1  # nothing lost
    r.xreadgroup(GROUP, "empty", {STREAM: ">"}, count=1)  # joins, holding nothing
    assert Reclaimer(r, STREAM, GROUP, "empty", 30_000, "echo").release() is True
    assert [c["name"] for c in r.xinfo_consumers(STREAM, GROUP)] == [b"holder"]


def test_stats_shows_a_consumer_dead_by_its_announcement(r: redis.Redis) -> None:
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for name in ("alive", "gone"):
        r.xgroup_createconsumer(STREAM, GROUP, name)
    now_ms = int(time.time() * 1000)
    r.hset("redbatch:workers:echo", mapping={
        "alive": json.dumps({"seen_ms": now_ms}),
        "gone": json.dumps({"seen_ms": now_ms - 600_000})})
    stats = read_stream_stats(r, "redbatch", "echo", GROUP)
    assert {c.name: c.live for c in stats.consumers} == {"alive": True, "gone": False}
    from rich.console import Console

    from worker.commands.stats import render
    console = Console(width=120, record=True)
    console.print(render([(stats, None)], GROUP))
    text = console.export_text()
    assert "live " in text and "dead 10 min" in text


def test_progress_lines_count_what_happened_since_the_last() -> None:
    fields = progress_fields(Totals(10, 1, 2, 100), Totals(30, 2, 6, 500), 10.0)
    assert fields == {"answered": 20, "errors": 1, "batches": 4, "requests_per_s": 2.0,
                      "tokens_per_s": 40.0, "seconds": 10.0}
    readings = iter([Totals(), Totals(5, 0, 1, 50)] + [Totals(5, 0, 1, 50)] * 100)
    with capture_logs() as logs:
        progress = ProgressLog("echo", 0.05, read=lambda _: next(readings)).start()
        time.sleep(0.2)
        progress.stop()
    lines = [e for e in logs if e["event"] == "worker.progress"]
    assert lines and lines[0]["answered"] == 5 and lines[0]["batches"] == 1
    assert ProgressLog("echo", 0).start()._thread.is_alive() is False  # 0 disables


def test_progress_reads_the_worker_counters(worker_factory: Any) -> None:
    from producer.client import Client
    from worker.observe.progress import read_totals

    with worker_factory(model="echo") as worker:
        before = read_totals("echo")
        client = Client(worker.settings.redis_url, "echo")
        for i in range(3):
            client.infer({"i": i}, timeout=10)
        time.sleep(0.05)  # counted just after the reply is written
        after = read_totals("echo")
        client.close()
    assert after.answered - before.answered == 3 and after.batches > before.batches


def test_warm_up_logs_a_start_and_an_end_line() -> None:
    with capture_logs() as logs, logged_step("warmup", model="echo"):
        pass
    assert [e["event"] for e in logs] == ["warmup.started", "warmup.done"]
    assert logs[1]["seconds"] >= 0 and logs[1]["model"] == "echo"
    with capture_logs() as logs, logged_step("warmup", end=False):
        pass  # calibration.warm_up logs its own warmup.done, with its seconds
    assert [e["event"] for e in logs] == ["warmup.started"]


def test_json_logs_turn_progress_bars_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in QUIET_BARS:
        monkeypatch.delenv(name, raising=False)
    assert quiet_progress_bars(json_logs=True) is True
    assert all(os.environ[name] == value for name, value in QUIET_BARS.items())


def test_a_taken_metrics_port_gets_a_hint() -> None:
    from worker.app import StartupError
    from worker.commands.readiness import Readiness
    from worker.commands.run import serve_metrics
    from worker.settings import load_settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = load_settings(None, metrics_port=port, metrics_host="127.0.0.1")
        with pytest.raises(StartupError, match="--metrics-port") as raised:
            serve_metrics(settings, Readiness())
    assert "--metrics-port 0" in str(raised.value) and "\n" not in str(raised.value)



def test_a_second_worker_on_the_metrics_port_gets_one_line(tmp_path: Any) -> None:
    """`python -m worker` on a taken port: exit 2, one line naming --metrics-port, no
    traceback (/metrics is served before Redis or the model are touched)."""
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "worker", "--model", "echo", "--metrics-host", "127.0.0.1",
             "--metrics-port", str(port), "--data-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "REDBATCH_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode == 2, done.stderr
    assert "--metrics-port" in done.stderr and "Traceback" not in done.stderr


pytestmark = pytest.mark.usefixtures("fresh_logs")
