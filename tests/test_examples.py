"""The clients in other languages (examples/) against a real worker: redis-cli and Node.js run
end to end; the Go client is checked by gofmt and `go vet` where Go and its modules are at hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TEXTS = ["plain words", 'quotes " and \\ backslash', "tab\there, ünïcode"]


def run_client(command: list[str], redis_url: str, cwd: Path = EXAMPLES,
               **env: str) -> list[dict[str, Any]]:
    done = subprocess.run(command + TEXTS, cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REDIS_URL": redis_url, "MODEL": "echo",
                               "TIMEOUT_S": "20", **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_echoed(envelopes: list[dict[str, Any]]) -> None:
    assert [e["result"] for e in envelopes] == [{"text": text} for text in TEXTS]
    assert all(e["ok"] and e["meta"]["model"] == "echo" for e in envelopes)


def test_redis_cli_example(redis_url: str, worker_factory: Any) -> None:
    if not shutil.which("redis-cli"):
        pytest.skip("redis-cli is not installed")
    with worker_factory(model="echo"):
        assert_echoed(run_client(["bash", "redis-cli.sh"], redis_url))


@pytest.fixture(scope="session")
def node_client() -> Path:
    """examples/node with its packages installed (`npm ci` from the committed lock file)."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    folder = EXAMPLES / "node"
    if not (folder / "node_modules").is_dir():
        try:
            done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=folder,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci timed out: is the npm registry reachable?")
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (registry unreachable?): {done.stderr[-300:]}")
    return folder


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
def test_node_example(redis_url: str, worker_factory: Any, node_client: Path,
                      content_type: str) -> None:
    with worker_factory(model="echo"):
        assert_echoed(run_client(["node", "client.mjs"], redis_url, cwd=node_client,
                                 CONTENT_TYPE=content_type))


def test_go_example_vets(tmp_path: Path) -> None:
    if not shutil.which("go"):
        pytest.skip("Go is not installed")
    source = EXAMPLES / "go"
    unformatted = subprocess.run(["gofmt", "-l", "-e", "."], cwd=source, capture_output=True,
                                 text=True, timeout=60)
    assert unformatted.returncode == 0 and not unformatted.stdout, unformatted.stderr
    work = tmp_path / "go"
    shutil.copytree(source, work)  # `go mod tidy` writes go.sum: keep the checkout clean
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPATH": str(tmp_path / "gopath"),
           "GOCACHE": str(tmp_path / "gocache")}
    try:
        tidy = subprocess.run(["go", "mod", "tidy"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("go mod tidy timed out: is the Go module proxy reachable?")
    if tidy.returncode != 0:
        reason = (tidy.stderr.strip().splitlines() or ["no output"])[-1][-200:]
        pytest.skip(f"Go modules could not be downloaded ({reason})")
    vet = subprocess.run(["go", "vet", "./..."], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300)
    assert vet.returncode == 0, vet.stderr
