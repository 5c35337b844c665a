"""The benchmark harness end to end in its seconds-long smoke mode (CI measures nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rigs.paths import REPO_ROOT

REPO = REPO_ROOT


@pytest.mark.slow
def test_smoke_run_writes_the_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [report] = tmp_path.glob("*-smoke.json")
    results = json.loads(report.read_text())
    for section in ("corpus", "saturation", "latency", "overhead", "scaling", "targets"):
        assert section in results
    saturation = results["saturation"]
    for config in ("offline", "redbatch", "fifo", "batch1", "defaults"):
        assert saturation[config]["median"] > 0
    assert sum(saturation["redbatch"]["batch_size_histogram"].values()) > 0
    assert results["overhead"]["worker_median"] > 0 and results["overhead"]["ratio"] > 0
    assert set(results["scaling"]["processes"]) == {"1", "2"}
    assert saturation["defaults"]["ratio_to_best_layout"] > 0
    assert len(results["targets"]) == 7  # no 4-process scaling in the smoke run
    markdown = report.with_suffix(".md").read_text()
    assert "## Targets" in markdown
    plots = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(plots) == 5 and all(name in markdown for name in plots)


@pytest.mark.slow
def test_generative_smoke_run_writes_the_report(tmp_path: Path) -> None:
    """Every system of the generative benchmark runs on the tiny model and agrees."""
    results, markdown = generative_bench(tmp_path, "--concurrency", "2", "3", "--repeats", "1")
    for by_system in results["throughput"]["tokens_per_s"].values():
        assert set(by_system) == {"redbatch", "engine", "static", "hf_static", "generate_batch"}
        assert all(system["median"] > 0 for system in by_system.values())
    assert results["throughput"]["greedy_agreement"] == {
        "engine_vs_static": 1.0, "engine_vs_hf_static": 1.0, "engine_vs_generate_batch": 1.0}
    ttft = results["ttft_ms"]
    assert ttft["unloaded"]["p50"] > 0 and len(ttft["unloaded"]["values"]) == 6
    assert len(ttft["80%"]["values"]) == 6 and ttft["80%"]["slowdown_p95"] > 0
    assert results["memory"]["peak_serving_mib"] > results["memory"]["weights_mib"]
    assert "## Time to first token" in markdown


def test_ttft_compares_each_request_with_itself_alone() -> None:
    """A long prompt slow alone is not counted as slowed down by the load."""
    from bench.generative.ttft import compare

    alone = [100.0] * 18 + [800.0, 800.0]
    loaded = [150.0] * 18 + [800.0, 800.0]
    row = compare(loaded, alone)
    assert row["slowdown_p50"] == pytest.approx(1.5)
    assert row["slowdown_p95"] == pytest.approx(1.5)
    assert row["p95_over_unloaded_p50"] > 4  # the old ratio: the long prompt counted as load
    with pytest.raises(ValueError):
        compare(loaded[:-1], alone)


@pytest.mark.slow
def test_generative_ttft_runs_on_two_worker_processes(tmp_path: Path) -> None:
    """`--workers 2`: the TTFT part on two worker processes sharing one stream."""
    results, markdown = generative_bench(tmp_path, "--concurrency", "3", "--ttft-only",
                                         "--workers", "2")
    assert results["workers"] == 2 and "throughput" not in results
    assert len(results["ttft_ms"]["50%"]["values"]) == 6
    assert "2 redbatch worker process(es)" in markdown


def generative_bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`python -m bench --generative` on the tiny model and 6 prompts: its JSON and report."""
    from tests.rigs.tiny_lm import build_tiny_lm

    model = build_tiny_lm(tmp_path / "tiny", n_positions=1024)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    options = json.dumps({"path": str(model), "max_new_tokens_limit": 256})
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--generative", "--model", "causal_lm",
         "--model-options", options, "--prompts", "6", *args, "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [report] = tmp_path.glob("*-generative-causal_lm.json")
    return json.loads(report.read_text()), report.with_suffix(".md").read_text()


def test_step_profile_counts_one_attention_per_layer_once_shaped_for_a_gpu(
        tmp_path: Path) -> None:
    import torch

    from bench.generative.step_profile import profile_steps
    from tests.rigs.tiny_lm import build_tiny_lm
    from worker.models import create_model

    model = create_model("causal_lm", {"path": str(build_tiny_lm(tmp_path))})
    model.load(torch.device("cpu"))
    layers = model.lm.config.n_layer
    rowwise = profile_steps(model, 4, gpu_shapes=False, capture=False)
    shaped = profile_steps(model, 4, gpu_shapes=True, capture=False)
    assert rowwise["decode"]["attention calls"] == 4 * layers
    assert shaped["decode"]["attention calls"] == layers
    assert shaped["prefill"]["attention calls"] == layers
    assert shaped["decode"]["aten ops"] < rowwise["decode"]["aten ops"]
    assert shaped["decode"]["copies in"] == 1 and shaped["decode"]["host syncs"] == 0


@pytest.mark.slow
def test_the_generative_host_path_benchmark_runs() -> None:
    """In a process of its own (it configures logging for the whole process); each round
    checks a request's reply stream: every token streamed, then its done entry. ~20 s, most
    of it SmolLM2's GGUF load: the benchmark serves the real tokenizer and model config."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.generative.host_path", "--requests", "6",
                           "--tokens", "5", "--concurrency", "4", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "tokens/s: median" in done.stdout and "host ms per decode step" in done.stdout
