"""`python -m worker demo`, the README's main job, end to end (echo model, so it is quick)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end_on_an_embedded_redis(tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("First text.\n\nA second, longer text than the first.\nThird.\n")
    done = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "echo", "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data"), "--sentences", str(texts), "--count", "3"],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "3 requests, 0 failed" in done.stdout
    assert "Traceback" not in done.stderr


def test_the_demo_tells_a_short_story(tmp_path: Path) -> None:
    """The default sample texts are found, warm-up is one line, and every info line is a
    step of the story: Redis started, model loaded, warmed up, serving, stopped."""
    done = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "echo", "--metrics-port", "0",
         "--data-dir", str(tmp_path / "data"), "--count", "5", "--log-format", "json"],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "5 requests, 0 failed" in done.stdout
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    info = [e["event"] for e in events if e["level"] == "info"]
    assert info == ["redis.embedded", "model.loaded", "warmup.done", "worker.serving",
                    "worker.stopping", "worker.stopped"], info
    warmed = next(e for e in events if e["event"] == "warmup.done")
    assert warmed["buckets"] > 0 and warmed["batch_size"] > 0 and "seconds" in warmed
