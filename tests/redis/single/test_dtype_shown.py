"""The dtype the model computes in is shown where a worker is described: the
`worker.serving` line, the workers hash (tests/redis/single/test_precision.py), and `stats`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis
from rich.console import Console
from structlog.testing import capture_logs

from worker.app import build_worker
from worker.commands.stats import render
from worker.settings import load_settings
from worker.streams.queue_stats import ConsumerStats, StreamStats, consumer_stats


def test_the_serving_line_names_the_dtype(redis_url: str, r: redis.Redis,
                                          tmp_path: Path) -> None:
    settings = load_settings(None, redis_url=redis_url, model="echo", dtype="bfloat16",
                             device="cpu", metrics_port=0, calibration_dir=tmp_path,
                             warmup=False)
    worker = build_worker(settings, r)
    with capture_logs() as logs:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        assert worker.ready.wait(30)
        worker.stop()
        thread.join(30)
    serving = [entry for entry in logs if entry["event"] == "worker.serving"]
    assert [entry["dtype"] for entry in serving] == ["bfloat16"]


def test_stats_shows_each_consumers_dtype() -> None:
    now = int(time.time() * 1000)
    consumer = consumer_stats({"name": b"w-1", "pending": 0, "idle": 5},
                              {"layout": "2 instance(s) x 1 thread(s)", "dtype": "bfloat16",
                               "seen_ms": now})
    assert consumer.dtype == "bfloat16"
    assert isinstance(consumer, ConsumerStats)
    console = Console(width=200, record=True)
    console.print(render([(StreamStats("minilm", 1, 0, 0, 0, 1, [consumer]), None)],
                         "redbatch"))
    assert "2 instance(s) x 1 thread(s), bfloat16" in console.export_text()
