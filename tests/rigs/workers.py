"""Workers running in-process threads against a real Redis, and models loaded once per session."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from worker.app import assemble_worker, connect
from worker.execution.executor import Executor, resolve_device
from worker.models import Model, create_model
from worker.pipeline.worker import Worker
from worker.settings import load_settings

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
                             connect(url, settings.block_ms, cluster=settings.redis_cluster))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(10)
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop"
