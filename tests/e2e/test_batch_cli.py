"""The batch CLI for real jobs (issue 33): generative models, a live worker first, a sliding
window, results in input order as they come, the input's own ids, line numbers as in the
file. A real Redis, real workers (echo and the tiny LM)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.batch import Item, Window
from tests.e2e.test_producer_cli import ROOT, announce, produce, results
from tests.rigs.tiny_lm import build_tiny_lm


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-cli"))


def test_plain_lines_to_a_generative_model_become_prompts(
        redis_url: str, worker_factory: Callable[..., Any], tiny_path: Path) -> None:
    options = {"path": str(tiny_path), "max_new_tokens": 4, "max_new_tokens_limit": 64}
    with worker_factory(model="causal_lm", model_options=options):
        done = produce("--redis-url", redis_url, "--model", "causal_lm",
                       stdin='hello there\n{"prompt": "more", "max_new_tokens": 2}\n')
    assert done.returncode == 0, done.stderr
    first, second = results(done.stdout)
    assert first["ok"] and first["result"]["tokens"] == 4 and first["line"] == 1
    assert second["result"]["tokens"] == 2 and second["line"] == 2


def test_no_live_worker_is_one_line_naming_the_live_models(
        redis_url: str, r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    with worker_factory(model="echo"):
        done = produce("--redis-url", redis_url, "--model", "smollm", stdin="hello\n")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("producer: no live worker serves model 'smollm'; models with a "
                           "live worker: echo (embedding) [--model from --model (flag); Redis "
                           f"{redis_url} from --redis-url (flag)]\n")
    assert not r.exists("redbatch:requests:smollm")


def test_wait_for_worker_waits_for_one(redis_url: str, tmp_path: Path,
                                       worker_factory: Callable[..., Any]) -> None:
    (tmp_path / "in.txt").write_text("late\n")
    command = [sys.executable, "-m", "producer", "--no-progress", "--redis-url", redis_url,
               "--model", "echo", "--wait-for-worker", "30", str(tmp_path / "in.txt")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT) as waiting:
        time.sleep(1.5)
        assert waiting.poll() is None  # still waiting: no worker yet
        with worker_factory(model="echo"):
            out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, err
    assert [e["result"] for e in results(out)] == [{"text": "late"}]


def test_jsonl_ids_are_kept_and_blank_lines_keep_the_file_numbers(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    lines = ['{"id": "a-1", "text": "one"}', "", "plain", "   ", '{"id": "b-2", "n": 2}']
    with worker_factory(model="echo"):
        done = produce("--redis-url", redis_url, "--model", "echo", stdin="\n".join(lines))
    assert done.returncode == 0, done.stderr
    got = results(done.stdout)
    assert [(e["id"], e["line"], e["result"]) for e in got if e["id"] != got[1]["id"]] == [
        ("a-1", 1, {"text": "one"}), ("b-2", 5, {"n": 2})]
    assert got[1]["line"] == 3 and got[1]["result"] == {"text": "plain"}


def test_a_duplicate_id_is_refused_before_anything_is_sent(r: redis.Redis,
                                                          redis_url: str) -> None:
    announce(r, "echo")
    done = produce("--redis-url", redis_url, "--model", "echo",
                   stdin='{"id": "x", "t": 1}\n\n{"id": "x", "t": 2}\n')
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("producer: cannot read input: line 3: id 'x' is already "
                                   "the id of line 1; ids must be unique")
    assert r.xlen("redbatch:requests:echo") == 0


def test_the_window_keeps_at_most_n_in_flight_and_writes_in_order(
        redis_url: str, r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    client, emitted = Client(redis_url, "echo"), []

    def emit(envelope: dict[str, Any]) -> None:
        in_flight = r.xlen("redbatch:requests:echo") - len(emitted)  # sent, not written
        assert in_flight <= 5, in_flight
        emitted.append(envelope)

    with worker_factory(model="echo", model_options={"per_item_ms": 2}, max_wait_ms=5):
        window = Window(client, 5, 30, 30)
        window.run((Item(f"r{n}", {"n": n}, {"line": n}) for n in range(40)), emit)
    assert [e["result"]["n"] for e in emitted] == list(range(40))
    assert [e["id"] for e in emitted] == [f"r{n}" for n in range(40)]
    assert window.most_in_flight == 5


def test_the_cli_window_flag(redis_url: str, worker_factory: Callable[..., Any]) -> None:
    with worker_factory(model="echo", max_wait_ms=5):
        done = produce("--redis-url", redis_url, "--model", "echo", "--window", "3",
                       stdin="".join(f"{n}\n" for n in range(25)))
    assert done.returncode == 0, done.stderr
    assert [e["result"]["text"] for e in results(done.stdout)] == [str(n) for n in range(25)]
    assert done.stderr.startswith("25 requests, 0 failed")


def test_help_mentions_serve() -> None:
    done = produce("--help")
    assert done.returncode == 0 and "python -m producer serve" in done.stdout
    assert "--wait-for-worker" in done.stdout and "--window" in done.stdout
    assert json.dumps  # (the module's JSON use is in results())


def test_max_backlog_waits_for_room_instead_of_refusing(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    with worker_factory(model="echo", model_options={"per_item_ms": 5}, max_wait_ms=5):
        done = produce("--redis-url", redis_url, "--model", "echo", "--max-backlog", "3",
                       "--window", "10", stdin="".join(f"{n}\n" for n in range(30)))
    assert done.returncode == 0, done.stderr
    assert [e["result"]["text"] for e in results(done.stdout)] == [str(n) for n in range(30)]


def test_the_cli_defaults_meet_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: the worker's embedded Redis URL file and its REDBATCH_MODEL are the CLI's
    defaults too (REDBATCH_REDIS_URL and REDBATCH_MODEL_NAME still win)."""
    from producer.cli import build_parser

    monkeypatch.chdir(tmp_path)
    for name in ("REDBATCH_REDIS_URL", "REDBATCH_MODEL_NAME", "REDBATCH_MODEL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".redbatch").mkdir()
    (tmp_path / ".redbatch" / "redis.url").write_text("redis://127.0.0.1:4242/0\n")
    monkeypatch.setenv("REDBATCH_MODEL", "mypkg.models:Reranker")
    args = build_parser().parse_args([])
    assert args.redis_url == "redis://127.0.0.1:4242/0" and args.model == "reranker"
    monkeypatch.setenv("REDBATCH_MODEL_NAME", "other")
    assert build_parser().parse_args([]).model == "other"
