"""`python -m worker --processes N`: restarts, signals, summed metrics; and poison input that
crashes a worker process every time it is delivered ends in the dead-letter stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import redis

from producer import Client
from producer.protocol import dead_letter_key, stream_key
from tests.rigs.chaos import (
    ECHO_FLAGS,
    ROOT,
    Replies,
    WorkerProcess,
    heaviest_on_redis_7_only,
    pending,
    report,
    wait_until,
)
from tests.rigs.plugin_models import POISON
from worker.settings import load_settings
from worker.streams.server import RedisServer, free_port
from worker.supervisor import child_settings, secret_environment, settings_flags

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in text.split()]


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """Children first: they run in their own sessions and would outlive the supervisor."""
    for pid in children(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.kill()
    process.wait()


def test_children_get_their_slot_names_devices_and_every_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(None, model="echo", consumer="host-1", devices="cuda:0, cuda:1",
                             bucket_boundaries=[8, 16], model_options={"delay_ms": 1})
    first, second = child_settings(settings, "redis://h:1/0")
    assert (first.consumer, first.device, second.consumer, second.device) == (
        "host-1-0", "cuda:0", "host-1-1", "cuda:1")
    assert first.metrics_port == 0 and first.processes == 1 and first.devices == ""
    from worker.cli import build_parser
    from worker.cli_flags import setting_overrides

    args = build_parser().parse_args(["run", *settings_flags(first)])
    for name, value in secret_environment(first).items():  # redis_url, by environment
        monkeypatch.setenv(name, value)
    assert load_settings(None, **setting_overrides(args)).model_dump() == first.model_dump()
    assert len(child_settings(load_settings(None, processes=3), "redis://h:1/0")) == 3


def test_supervisor_gives_up_when_children_cannot_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worker", "--processes", "2", "--model", "echo",
         "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--metrics-port", "0"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2
    assert "cannot reach Redis" in result.stderr and "child.cannot_start" in result.stderr


def test_supervisor_restarts_a_killed_child_and_sums_their_metrics(
        redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    heaviest_on_redis_7_only(r)
    port = free_port()
    log = (tmp_path / "supervisor.log").open("wb")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "worker", "--processes", "2", "--redis-url", redis_url,
         "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--consumer", "sup",
         "--log-format", "json", "--device", "cpu", *ECHO_FLAGS],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log)
    def consumers() -> set[str]:
        try:
            return {c["name"].decode() for c in r.xinfo_consumers(stream, "workers")}
        except redis.ResponseError:  # no group yet
            return set()

    stream = stream_key("redbatch", "echo")
    try:
        wait_until(lambda: consumers() == {"sup-0", "sup-1"}, 90, "both children reading")
        for probe in ("healthz", "readyz"):  # the probes on the supervisor's port
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/{probe}", timeout=10).status \
                == 200
        client = Client(redis_url, "echo")
        reply_key = client.new_reply_key()
        ids = client.submit_many(({"i": i} for i in range(600)), reply_to=reply_key)
        replies = Replies(redis_url, reply_key)
        wait_until(lambda: replies.poll() >= 0 and len(replies.counts) >= 100, 90, "load")
        victim = children(supervisor.pid)[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: len(children(supervisor.pid)) == 2
                   and victim not in children(supervisor.pid), 30, "a replacement child")
        replies.wait_for(ids, 90)
        replies.linger(0.5)
        assert replies.duplicates == 0 and not pending(r, stream)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        ok_line = next(line for line in metrics.decode().splitlines()
                       if line.startswith('redbatch_requests_total{model="echo",status="ok"}'))
        shares = Counter(replies.envelopes[i]["meta"]["worker"] for i in ids)
        counted = float(ok_line.split()[-1])
        # Both children's counts, the killed one's included (less what it answered but had
        # not counted yet when it died: at most one batch).
        assert len(ids) - 16 <= counted <= len(ids) and set(shares) == {"sup-0", "sup-1"}
        assert 'redbatch_backlog{model="echo"}' in metrics.decode()
        assert consumers() == {"sup-0", "sup-1"}  # the replacement kept its slot's name
        grandchildren = children(supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in grandchildren)
    finally:
        kill_tree(supervisor)
        log.close()


def test_poison_input_ends_in_the_dead_letter_stream(redis_url: str, r: redis.Redis,
                                                     tmp_path: Path) -> None:
    heaviest_on_redis_7_only(r)
    max_deliveries = 2
    supervisor = WorkerProcess(redis_url, tmp_path / "poison.log", *ECHO_FLAGS,
                               "--model", "tests.rigs.plugin_models:PoisonEcho", "--processes", "2",
                               "--consumer", "p", "--max-deliveries", str(max_deliveries),
                               "--claim-idle-ms", "600000")  # recovery by the successor only
    stream = stream_key("redbatch", "poisonecho")
    try:
        client = Client(redis_url, "poisonecho")
        reply_key = client.new_reply_key()
        payloads = [{"i": i} for i in range(100)]
        payloads.insert(50, POISON)
        started = time.monotonic()
        ids = client.submit_many(payloads, reply_to=reply_key)
        replies = Replies(redis_url, reply_key)
        replies.wait_for(ids, 120)
        recovered_s = time.monotonic() - started
        replies.linger(0.5)
        poison_reply = replies.envelopes[ids[50]]
        assert poison_reply["error"]["code"] == "dead_letter"
        assert all(replies.envelopes[i]["ok"] for i in ids[:50] + ids[51:])
        assert replies.duplicates == 0 and not pending(r, stream)
        [(_, dead)] = r.xrange(dead_letter_key("redbatch", "poisonecho"))
        assert int(dead[b"dead:deliveries"]) == max_deliveries + 1
        assert dead[b"id"].decode() == ids[50]
        crashes = supervisor.log.read_text().count('"event": "child.died"')
        assert crashes == max_deliveries
        supervisor.signal(signal.SIGTERM)
        assert supervisor.process.wait(30) == 0
        report("poison", redis=r.info()["redis_version"], sent=len(ids),
               answered=len(replies.counts), duplicates=replies.duplicates,
               pending_left=len(pending(r, stream)), worker_crashes=crashes,
               dead_lettered=1, max_deliveries=max_deliveries, all_answered_after_s=recovered_s)
        cli = [sys.executable, "-m", "worker", "dead-letters", "--redis-url", redis_url,
               "--model", "tests.rigs.plugin_models:PoisonEcho"]
        listed = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        [line] = listed.stdout.splitlines()
        assert json.loads(line)["request_id"] == ids[50], listed.stderr
        requeued = subprocess.run([*cli, "--requeue-all"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert requeued.returncode == 0, requeued.stderr
        assert r.xlen(dead_letter_key("redbatch", "poisonecho")) == 0
        assert r.xrevrange(stream, count=1)[0][1][b"id"].decode() == ids[50]
    finally:
        kill_tree(supervisor.process)


PASSWORD = "p@ss:w/rd #%?&"  # would break a URL: the password setting takes it as it is


def test_the_password_setting_reaches_every_child_by_environment_only(tmp_path: Path) -> None:
    """A Redis with requirepass; the password in REDBATCH_REDIS_PASSWORD, not in the URL.
    Both children serve, `stats` reads, and no command line (`ps`) shows the password."""
    with RedisServer(tmp_path / "redis") as server:
        redis.Redis.from_url(server.url).config_set("requirepass", PASSWORD)
        r = redis.Redis.from_url(server.url, password=PASSWORD)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REDBATCH_REDIS_URL": server.url,
               "REDBATCH_REDIS_PASSWORD": PASSWORD}
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "worker", "--processes", "2", "--metrics-port", "0",
             "--consumer", "pw", "--device", "cpu", *ECHO_FLAGS], cwd=ROOT, env=env,
            stderr=(tmp_path / "supervisor.log").open("wb"))
        try:
            stream = stream_key("redbatch", "echo")
            wait_until(lambda: bool(r.exists(stream)) and {c["name"].decode() for c in
                       r.xinfo_consumers(stream, "workers")} == {"pw-0", "pw-1"}, 90,
                       "both children reading")
            assert Client(redis_client=r, model="echo").infer({"x": 1}, timeout=30) == {"x": 1}
            for pid in [supervisor.pid, *children(supervisor.pid)]:
                assert PASSWORD.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            stats = subprocess.run([sys.executable, "-m", "worker", "stats", "--json",
                                    "--interval", "0"], cwd=ROOT, env=env,
                                   capture_output=True, text=True, timeout=60)
            assert stats.returncode == 0, stats.stderr
            assert [m["model"] for m in json.loads(stats.stdout)["models"]] == ["echo"]
            supervisor.send_signal(signal.SIGTERM)
            assert supervisor.wait(30) == 0
        finally:
            kill_tree(supervisor)
    assert PASSWORD not in (tmp_path / "supervisor.log").read_text()


def test_secret_settings_go_to_children_by_environment() -> None:
    settings = load_settings(None, redis_url="redis://h:1/0", redis_password=PASSWORD)
    flags = settings_flags(settings)
    assert "--redis-url" not in flags and "--redis-password" not in flags
    assert secret_environment(settings) == {"REDBATCH_REDIS_URL": "redis://h:1/0",
                                            "REDBATCH_REDIS_PASSWORD": PASSWORD}
