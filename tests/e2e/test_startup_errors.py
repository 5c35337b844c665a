"""`python -m worker` refuses a bad start-up with one clear line and a non-zero exit.

The processes are started together once per module (each imports torch: seconds) and each
case then checks its own outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.rigs.paths import REPO_ROOT
from worker.streams.server import free_port

ROOT = REPO_ROOT


@dataclass(frozen=True)
class Case:
    args: list[str]
    message: str
    env: dict[str, str] | None = None


CASES = {
    "invalid flag value": Case(["--max-batch-size", "0"],
                               "invalid setting 'max_batch_size' from --max-batch-size (flag)"),
    "invalid environment value": Case([], "invalid setting 'max_wait_ms' from "
                                      "REDBATCH_MAX_WAIT_MS (environment)",
                                      {"REDBATCH_MAX_WAIT_MS": "soon"}),
    "invalid instances": Case(["--instances", "many"], "invalid setting 'instances'"),
    "latency target not positive": Case(["--latency-target-ms", "0"],
                                        "invalid setting 'latency_target_ms'"),
    "latency percentile outside (0, 1)": Case(["--latency-percentile", "1.5"],
                                              "invalid setting 'latency_percentile'"),
    "baseline controller with a latency target": Case(
        ["--batch-controller", "aimd", "--controller-target-ms", "50",
         "--latency-target-ms", "100"],
        "batch_controller 'aimd' is a baseline that replaces latency_target_ms"),
    "malformed JSON flag": Case(["--bucket-boundaries", "[16,"], "--bucket-boundaries takes JSON"),
    "missing config file": Case(["--config", "{tmp}/absent.toml"], "config file not found"),
    "broken config file": Case(["--config", "{tmp}/broken.toml"],
                               "broken.toml is not valid TOML"),
    "rule across settings, with a password in the URL": Case(
        ["--redis-url", "redis://:hunter2@127.0.0.1:{port}/0", "--batch-controller", "aimd"],
        "invalid settings: batch_controller 'aimd' needs controller_target_ms "
        "[--batch-controller (flag); controller_target_ms (default)]"),
    "calibration directory that cannot take a file": Case(
        ["calibrate", "--calibration-dir", "{tmp}/broken.toml/calibration"],
        "calibration_dir '{tmp}/broken.toml/calibration' cannot take the calibration file"),
    "unknown model": Case(["--model", "nope"], "unknown model 'nope'"),  # and from where:
    "unknown model from the environment": Case([], "[REDBATCH_MODEL (environment)]",
                                               {"REDBATCH_MODEL": "nope"}),
    "model that cannot load": Case(["--model", "tests.rigs.plugin_models:UnloadableModel"],
                                   "cannot load model 'tests.rigs.plugin_models:UnloadableModel': "
                                   "FileNotFoundError: weights.bin not found"),
    # {{ }}: the arguments go through str.format
    "bad model option": Case(["--model", "minilm", "--model-options", '{{"trace": "no"}}'],
                             "bad model_options for 'minilm': trace must be true, false or null"),
    "unreachable Redis": Case(["--redis-url", "redis://127.0.0.1:{port}/0"],
                              "cannot reach Redis at redis://127.0.0.1:{port}/0"),
    "unreachable Redis from the environment": Case(
        [], "[REDBATCH_REDIS_URL (environment)]",
        {"REDBATCH_REDIS_URL": "redis://127.0.0.1:{port}/0"}),
}


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stderr: str
    message: str


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    tmp = tmp_path_factory.mktemp("startup")
    (tmp / "broken.toml").write_text("max_batch_size = [unclosed\n")
    fill = {"tmp": str(tmp), "port": str(free_port())}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("REDBATCH_")}
    base_env["PYTHONPATH"] = str(ROOT)
    # Where a case gets past the settings, the worker starts an embedded Redis under tmp.
    common = ["--metrics-port", "0", "--log-level", "error", "--data-dir", str(tmp / "data")]
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-m", "worker", *(a.format(**fill) for a in case.args), *common],
            cwd=ROOT, text=True,
            env={**base_env, **{k: v.format(**fill) for k, v in (case.env or {}).items()}},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for name, case in CASES.items()}
    results = {}
    for name, process in processes.items():
        try:
            _, stderr = process.communicate(timeout=300)  # 13 torch imports share 2 cores
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        results[name] = Outcome(process.returncode, stderr,
                                CASES[name].message.format(**fill))
    return results


@pytest.mark.parametrize("name", CASES)
def test_one_clear_line_and_a_non_zero_exit(outcomes: dict[str, Outcome], name: str) -> None:
    outcome = outcomes[name]
    assert outcome.returncode == 2, outcome.stderr
    assert "Traceback" not in outcome.stderr and "hunter2" not in outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1, outcome.stderr
    assert lines[0].startswith("redbatch: ") and outcome.message in lines[0]
