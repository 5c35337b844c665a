"""`python -m producer` as a user runs it: a subprocess, with a worker serving in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tests.rigs.paths import REPO_ROOT
from worker.streams.server import free_port

ROOT = REPO_ROOT


def produce(*args: str, stdin: str = "",
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m producer` with no REDBATCH_* variable but those of `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REDBATCH_")}
    return subprocess.run([sys.executable, "-m", "producer", "--no-progress", *args],
                          input=stdin, capture_output=True, text=True, cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=60)


def results(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_jsonl_and_plain_lines_come_back_in_input_order(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    long_text = "a long line " * 30  # a later bucket than the rest: answered in another batch
    lines = [long_text, '{"text": "json", "n": 1}', "", "plain words", '{"x": [1, 2]}']
    with worker_factory(max_wait_ms=50):
        done = produce("--redis-url", redis_url, "--model", "echo", stdin="\n".join(lines))
    assert done.returncode == 0, done.stderr
    assert [e["result"] for e in results(done.stdout)] == [
        {"text": long_text}, {"text": "json", "n": 1}, {"text": "plain words"}, {"x": [1, 2]}]
    assert done.stderr.strip().startswith("4 requests, 0 failed, ")
    assert done.stderr.strip().endswith(" requests/s")


def test_a_failed_request_makes_the_exit_status_1(
        tmp_path: Path, redis_url: str, worker_factory: Callable[..., Any]) -> None:
    source, output = tmp_path / "in.txt", tmp_path / "out.jsonl"
    source.write_text("fine\nboom\nalso fine\n")
    with worker_factory(model="tests.rigs.plugin_models:FaultyModel", model_name="faulty",
                        max_batch_size=1):
        done = produce("--redis-url", redis_url, "--model", "faulty", "--json", str(source),
                       "-o", str(output))
    assert done.returncode == 1 and done.stdout == ""
    envelopes = results(output.read_text())
    assert [e["ok"] for e in envelopes] == [True, False, True]
    assert envelopes[1]["error"]["code"] == "model_error"
    assert "3 requests, 1 failed" in done.stderr


def announce(r: redis.Redis, model: str, generative: bool = False) -> None:
    """A worker of `model` that announced itself just now (as a live one does), serving
    nothing."""
    entry = json.dumps({"seen_ms": int(time.time() * 1000), "generative": generative})
    r.hset(f"redbatch:workers:{model}", "silent", entry)
    r.hset("redbatch:models", model, entry)


def test_unanswered_requests_count_as_timeouts(redis_url: str, r: redis.Redis) -> None:
    announce(r, "echo")
    done = produce("--redis-url", redis_url, "--model", "echo", "--timeout", "0.3",
                   stdin="nobody serves this\n")
    assert done.returncode == 1
    assert results(done.stdout)[0]["error"]["code"] == "timeout"


def test_a_bad_input_line_is_refused_before_anything_is_sent(r: redis.Redis,
                                                             redis_url: str) -> None:
    done = produce("--redis-url", redis_url, "--model", "echo", stdin='fine\n{"text": oops}\n')
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "producer: cannot read input: line 2: invalid JSON " \
                                  "(Expecting value)"
    assert r.xlen("redbatch:requests:echo") == 0


def test_a_missing_input_file(tmp_path: Path) -> None:
    done = produce(str(tmp_path / "absent.jsonl"))
    assert done.returncode == 2 and "cannot read input" in done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_redis_is_one_clear_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    done = produce("--redis-url", url, stdin="hello\n")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"producer: Redis error at {url}: ")
    assert line.endswith("[--redis-url from --redis-url (flag)]")


def test_a_message_names_where_the_model_and_the_redis_came_from(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    """No flags: the model from the environment, the URL from the environment."""
    with worker_factory(model="echo"):
        done = produce(stdin="hello\n", env={"REDBATCH_REDIS_URL": redis_url,
                                            "REDBATCH_MODEL": "nope"})
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"[--model from REDBATCH_MODEL (environment); Redis {redis_url} from "
        "REDBATCH_REDIS_URL (environment)]")


def test_help_lists_serve_and_each_default() -> None:
    """Issue 33: `producer --help` names the gateway command and every flag's default, and
    never prints a password from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDBATCH_")}
    done = subprocess.run([sys.executable, "-m", "producer", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60,
                          env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "100",
                               "REDBATCH_REDIS_URL": "redis://:hunter2@127.0.0.1:6390/0"})
    assert done.returncode == 0, done.stderr
    usage = done.stdout.split("\n\n", 1)[0]
    assert "python -m producer serve" in usage and "\n  serve " in done.stdout
    flat = " ".join(done.stdout.split())
    for default in ("(default: 1000)", "(default: 300.0)", "(default: -1)", "now minilm",
                    "(default: redbatch)"):
        assert default in flat, default
    assert "hunter2" not in done.stdout and "now redis://:***@127.0.0.1:6390/0" in flat


def test_a_bad_gateway_setting_names_where_it_came_from(monkeypatch: Any) -> None:
    from producer.gateway.settings import GatewaySettingsError, load_gateway_settings

    for name in ("REDBATCH_PORT", "REDBATCH_MAX_INPUTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REDBATCH_MAX_INPUTS", "many")
    try:
        load_gateway_settings(port="abc")
    except GatewaySettingsError as exc:
        lines = str(exc).splitlines()
    else:
        raise AssertionError("the settings were accepted")
    assert any(line.startswith("invalid setting 'port' from --port (flag): ") for line in lines)
    assert any(line.startswith("invalid setting 'max_inputs' from REDBATCH_MAX_INPUTS "
                               "(environment): ") for line in lines), lines
