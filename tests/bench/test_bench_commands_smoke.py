"""`python -m bench...` commands that had no run of their own in the tests, each on a short
input in a subprocess as a user runs it (issue 45 item 6): the live latency benchmark's
default goals (G1, G3) with the latency policy beside a static setting, its probe, its
report, and the gateway comparison. They measure nothing; they fail when a flag, a default
or a rig changed under a command (an earlier run lost every request and measured 0
windows without any test failing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rigs.paths import REPO_ROOT


def bench(*args: str, timeout_s: float = 240) -> str:
    """`python -m <args>` from the repository root; its stdout (stderr on failure)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default goals (G1 step load, G3 overload) on 1 s phases, on the latency policy
    (the static settings run in test_latency_bench_smoke.py's G2, G4 and G5)."""
    out = tmp_path_factory.mktemp("live") / "goals.json"
    bench("bench.latency.live", "--capacity", "200", "--phase-s", "1", "--paced-warmup",
          "--reply-timeout-s", "10", "--only", "redbatch", "--out", str(out))
    return out


def test_the_live_latency_benchmark_answers_every_request_and_measures_windows(
        live: Path) -> None:
    results: dict[str, Any] = json.loads(live.read_text())
    for goal in ("G1 step load", "G3 overload"):
        assert set(results[goal]) == {"redbatch"}
        for row in results[goal].values():
            assert row["unanswered"] == 0
            assert row["windows_p99_ms"] and all(ms > 0 for ms in row["windows_p99_ms"])
            assert row["goodput_per_phase"] and all(g > 0 for g in row["goodput_per_phase"])
    assert len(results["G1 step load"]["redbatch"]["goodput_per_phase"]) == 3
    overload = results["G3 overload"]["redbatch"]
    assert overload["refused"] >= 0 and 0 < overload["admitted_within_t"] <= 1
    assert overload["refused_within_bar"] is None or 0 <= overload["refused_within_bar"] <= 1


def test_the_live_report_renders_the_run(live: Path) -> None:
    markdown = bench("bench.latency.live.report", str(live), timeout_s=60)
    assert "G1 step load" in markdown and "G3 overload" in markdown
    assert "| redbatch |" in markdown


def test_the_probe_splits_a_request_path_on_a_real_worker() -> None:
    out = bench("bench.latency.live.probe", "G3", "--capacity", "200", "--phase-s", "1")
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert summary["unanswered"] == 0 and summary["windows_p99_ms"][0] > 0
    assert "served XADD -> written (ms): p50" in out and "batch size:" in out


def test_the_gateway_comparison_runs_both_paths() -> None:
    out = bench("bench.gateway", "--corpus", "32", "--batch", "8", "--clients", "2",
                "--repeats", "1", "--duration", "0.5")
    assert "saturation texts/s: direct" in out and "gateway/direct" in out
    assert "p50 at half load" in out
