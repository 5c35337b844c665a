"""The clients in other languages (examples/) against a real worker: redis-cli, Node.js and Go
run end to end and must print the right answers. The Go client is built offline from Debian's
packaged Go libraries (examples/go/vendor-debian.sh), and checked by gofmt and `go vet`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from producer import Client
from tests.rigs.node import npm_installed
from tests.rigs.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "examples"
TEXTS = ["plain words", 'quotes " and \\ backslash', "tab\there, ünïcode"]


def run_client(command: list[str], redis_url: str, cwd: Path = EXAMPLES,
               **env: str) -> list[dict[str, Any]]:
    done = subprocess.run(command + TEXTS, cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REDIS_URL": redis_url, "MODEL": "echo",
                               "TIMEOUT_S": "20", **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_echoed(envelopes: list[dict[str, Any]]) -> None:
    """One successful reply per text, in order, from the echo model: the payload back."""
    assert [e["result"] for e in envelopes] == [{"text": text} for text in TEXTS]
    assert all(e["ok"] and e["meta"]["model"] == "echo" for e in envelopes)
    ids = [e["id"] for e in envelopes]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), ids


def embedded(redis_url: str, worker_factory: Any, command: list[str], cwd: Path,
             content_type: str) -> None:
    """MiniLM's embeddings as float32 bytes (`ENCODING=float32`), decoded by the client to
    the numbers the default list of floats carries (the Python client's, same texts)."""
    client = Client(redis_url, "minilm", content_type=content_type)
    with worker_factory(model="minilm", max_wait_ms=20):
        got = run_client(command, redis_url, cwd=cwd, MODEL="minilm", ENCODING="float32",
                         CONTENT_TYPE=content_type)
        want = [client.infer({"text": text}, timeout=60) for text in TEXTS]
    client.close()
    assert [e["ok"] for e in got] == [True] * len(TEXTS)
    for envelope, expected in zip(got, want, strict=True):
        vector = envelope["result"]["embedding"]
        assert isinstance(vector, list) and len(vector) == 384
        assert envelope["result"]["tokens"] == expected["tokens"]
        assert max(abs(a - b) for a, b in zip(vector, expected["embedding"], strict=True)) < 1e-5


def test_redis_cli_example(redis_url: str, worker_factory: Any) -> None:
    if not shutil.which("redis-cli"):
        pytest.skip("redis-cli is not installed")
    with worker_factory(model="echo"):
        assert_echoed(run_client(["bash", "redis-cli.sh"], redis_url))


@pytest.fixture(scope="session")
def node_client() -> Path:
    """examples/node with its packages installed (`npm ci` from the committed lock file)."""
    folder = EXAMPLES / "node"
    return npm_installed(folder, folder / "node_modules")


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
def test_node_example(redis_url: str, worker_factory: Any, node_client: Path,
                      content_type: str) -> None:
    with worker_factory(model="echo"):
        assert_echoed(run_client(["node", "client.mjs"], redis_url, cwd=node_client,
                                 CONTENT_TYPE=content_type))


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
def test_node_example_decodes_float32_embeddings(redis_url: str, worker_factory: Any,
                                                 node_client: Path, content_type: str) -> None:
    embedded(redis_url, worker_factory, ["node", "client.mjs"], node_client, content_type)


# Debian's golang-*-dev packages put their sources here; examples/go/vendor-debian.sh makes a
# vendor/ of them, so the Go client builds without the module proxy.
GOCODE = Path(os.environ.get("GOCODE", "/usr/share/gocode/src"))
GO_PACKAGES = ("golang-go golang-github-gomodule-redigo-dev "
               "golang-github-vmihailenco-msgpack.v5-dev")


def go_env(tmp: Path) -> dict[str, str]:
    """Module mode, vendored packages only: nothing is looked up on the network."""
    return {**os.environ, "GO111MODULE": "on", "GOFLAGS": "-mod=vendor", "GOPROXY": "off",
            "GOSUMDB": "off", "GOWORK": "off", "GOTOOLCHAIN": "local", "GOCODE": str(GOCODE),
            "GOPATH": str(tmp / "gopath"), "GOCACHE": str(tmp / "gocache")}


def go(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    done = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"go {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture(scope="session")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/go compiled offline: vendor/ from Debian's Go library sources (the versions
    go.mod pins), then `go build -mod=vendor`. Returns the binary."""
    if not (shutil.which("go") and shutil.which("gofmt")):
        pytest.skip(f"Go is not installed (Debian: apt-get install {GO_PACKAGES})")
    tmp = tmp_path_factory.mktemp("go")
    work = tmp / "client"  # vendor/ and the binary stay out of the checkout
    shutil.copytree(EXAMPLES / "go", work,
                    ignore=shutil.ignore_patterns("vendor", "redbatch-client"))
    env = go_env(tmp)
    required = [r["Path"] for r in json.loads(go(["mod", "edit", "-json"], work, env))["Require"]]
    missing = [path for path in required if not (GOCODE / path / "go.mod").is_file()]
    if missing:
        pytest.skip(f"Debian's Go library sources are absent from {GOCODE} ({', '.join(missing)}):"
                    f" apt-get install {GO_PACKAGES}")
    vendored = subprocess.run(["bash", "vendor-debian.sh"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=60)
    assert vendored.returncode == 0, vendored.stderr
    go(["build", "-o", "redbatch-client", "."], work, env)
    return work / "redbatch-client"


def test_go_example_vets(go_client: Path, tmp_path: Path) -> None:
    sources = sorted(p.name for p in (EXAMPLES / "go").glob("*.go"))  # not a local vendor/
    assert sources
    unformatted = subprocess.run(["gofmt", "-l", "-e", *sources], cwd=EXAMPLES / "go",
                                 capture_output=True, text=True, timeout=60)
    assert unformatted.returncode == 0 and not unformatted.stdout, (
        unformatted.stdout + unformatted.stderr)
    go(["vet", "./..."], go_client.parent, go_env(tmp_path))


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
def test_go_example(redis_url: str, worker_factory: Any, go_client: Path,
                    content_type: str) -> None:
    with worker_factory(model="echo"):
        assert_echoed(run_client([str(go_client)], redis_url, CONTENT_TYPE=content_type))


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
def test_go_example_decodes_float32_embeddings(redis_url: str, worker_factory: Any,
                                               go_client: Path, content_type: str) -> None:
    embedded(redis_url, worker_factory, [str(go_client)], EXAMPLES, content_type)


def test_go_example_reports_timeouts(redis_url: str, go_client: Path) -> None:
    """No worker: every request times out, each is printed as a failed envelope, exit 1."""
    done = subprocess.run([str(go_client), *TEXTS[:2]], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDIS_URL": redis_url,
                                           "MODEL": "echo", "TIMEOUT_S": "1"})
    assert done.returncode == 1, done.stdout + done.stderr
    envelopes = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["ok"], e["error"]["code"]) for e in envelopes] == [(False, "timeout")] * 2
    assert "2 of 2 requests failed" in done.stderr
