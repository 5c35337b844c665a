"""`python -m worker demo`, the README's main job, end to end (echo model, so it is quick)."""

from __future__ import annotations

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
