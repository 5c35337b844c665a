"""`python -m bench...` commands that had no run of their own in the tests, each on a short
input in a subprocess as a user runs it (issue 45 item 6): the live latency benchmark's
default goals (G1, G3) with the latency policy beside a static setting, its probe, its
report, the gateway comparison, the dashboard snapshot, the latency simulator's goals, Redis
Cluster against one Redis, the generative step profile and the exactness run. They measure
nothing; they fail when a flag, a default or a rig changed under a command (an earlier run
lost every request and measured 0 windows without any test failing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rigs.paths import REPO_ROOT
from tests.rigs.servers import system_redis
from tests.rigs.tiny_lm import build_tiny_lm


def bench(*args: str, timeout_s: float = 240, env: dict[str, str] | None = None) -> str:
    """`python -m <args>` from the repository root (`env`: added to the environment); its
    stdout (stderr on failure)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
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


def test_the_dashboard_snapshot_answers_every_request_and_draws_the_panels(
        tmp_path: Path) -> None:
    """One wave of 20 sentences; the worker skips its warm-up (6 s of a 24 s run), which the
    snapshot's figures do not need. The 6 s lead-in stays: a rate needs 5 scrapes before."""
    png = tmp_path / "dashboard.png"
    out = bench("bench.dashboard", "--out", str(png), "--waves", "1", "--texts", "20",
                "--pause", "1", "--tail", "1", env={"REDBATCH_WARMUP": "false"})
    assert png.stat().st_size > 0
    assert "redbatch queues" in out  # `worker stats`, run mid-wave, still answers
    summary = next(line for line in out.splitlines() if line.startswith("answered "))
    answered, _, sent = summary.removeprefix("answered ").split(";")[0].split()[:3]
    assert answered == sent == "20"
    assert float(summary.split("peak ")[1].split()[0]) > 0


def test_the_latency_simulator_runs_every_goal_for_every_policy(tmp_path: Path) -> None:
    """The MiniLM cost model only, 10 s phases (one window each), 5 s capacity probes."""
    figures = tmp_path / "sim.json"
    out = bench("bench.latency.sim", "--phase-s", "10", "--scenarios", "minilm",
                "--capacity-s", "5", "--json", str(figures))
    (scenario,) = json.loads(figures.read_text()).values()
    assert scenario["capacity_per_s"] > 0
    policies = {"redbatch", "aimd", "step", "dynamic_timeout", "bentoml_cork"}
    for goal in ("G1 step load", "G2 light load", "G3 overload", "G4 drift",
                 "G5 mixed lengths"):
        assert set(scenario[goal]) == policies, goal
    for row in scenario["G1 step load"].values():
        assert len(row["windows_ms"]) == 3 and all(ms > 0 for ms in row["windows_ms"])
    assert all(row["bucket_percentiles_ms"] for row in scenario["G5 mixed lengths"].values())
    assert scenario["G3 overload"]["redbatch"]["goodput_vs_c"] > 0
    assert "| redbatch |" in out and "G5 worst bucket p99" in out


@pytest.mark.skipif(system_redis() is None or not shutil.which("redis-cli"),
                    reason="needs Redis 7+ and redis-cli")
def test_the_cluster_comparison_drains_every_target(tmp_path: Path) -> None:
    """12,000 echo requests, once per target: the fastest drains them in ~0.4 s, so a poll
    held up on a busy machine still leaves a window to time (at 4,000, one poll once saw most
    of the drain, and the worker's CPU read 0). ~20 s: the cluster's start (7 s) and a
    worker process per target."""
    out = tmp_path / "cluster"
    markdown = bench("bench.redis_cluster", "--requests", "12000", "--repeats", "1",
                     "--out", str(out))
    result = json.loads(out.with_suffix(".json").read_text())
    targets = result["targets"]
    assert list(targets) == ["one Redis", "cluster, replicas_to_wait 0",
                             "cluster, replicas_to_wait 1"]
    for target in targets.values():
        assert target["rate"] > 0 and target["submit_rate"] > 0
        assert target["cpu_us_per_request"] > 0 and target["worker_cpu_us_per_request"] > 0
    for name in ("cluster, replicas_to_wait 0", "cluster, replicas_to_wait 1"):
        shares = targets[name]["share_per_master"]
        assert len(shares) == 3 and sum(shares.values()) == pytest.approx(1.0)  # none lost
    assert result["derived"]["cluster_vs_one"] > 0 and result["spread"]["names_tried"] > 0
    assert "| cluster, replicas_to_wait 1 |" in markdown


def tiny_lm_options(tmp_path: Path) -> str:
    """--model-options for causal_lm on the tests' tiny GPT-2 (seconds, not SmolLM2's 15 s)."""
    return json.dumps({"path": str(build_tiny_lm(tmp_path / "tiny", n_positions=1024))})


def test_the_step_profile_counts_both_paths_on_the_tiny_model(tmp_path: Path) -> None:
    out = bench("bench.generative.step_profile", "--model", "causal_lm", "--model-options",
                tiny_lm_options(tmp_path), "--rows", "4")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| pre")
            or line.startswith("| decode")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("prefill", "row by row"), ("prefill", "GPU-shaped"),
        ("decode", "row by row"), ("decode", "GPU-shaped")]
    for cells in rows:
        aten_ops, attention_calls = int(cells[2]), int(cells[3])
        assert aten_ops > 0 and attention_calls > 0


def test_the_exactness_run_matches_every_prompt_on_the_tiny_model(tmp_path: Path) -> None:
    """8 prompts of at most 16 tokens and a KV budget so small that sequences are preempted:
    each path of the batched run (chunks, preemption, a decode batch) taken at least once."""
    bench("bench.generative.exactness", "--model", "causal_lm", "--model-options",
          tiny_lm_options(tmp_path), "--prompts", "8", "--max-new", "16", "--kv-tokens", "64",
          "--out", str(tmp_path / "out"))
    (data,) = (tmp_path / "out").glob("*-causal_lm-exactness-float32-cpu.json")
    report = json.loads(data.read_text())
    summary = report["summary"]
    assert summary["prompts"] == len(report["requests"]) == 8
    assert summary["match_rate"] == 1.0  # the tiny model's choices are far from ties
    assert summary["tokens"] > 0 and summary["preemptions"] > 0
    assert summary["chunked_requests"] > 0 and summary["widest"] >= 2
    assert data.with_suffix(".md").read_text().startswith("# causal_lm continuous-batching")
