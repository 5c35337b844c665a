"""Calibration policy, the calibrate command, and what the worker loads and warms at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.rigs.paths import REPO_ROOT
from tests.rigs.plugin_models import CostModel, FixedMemory, PressureModel
from worker.app import StartupError, build_worker
from worker.execution import calibration
from worker.execution.calibration import (
    batch_sizes,
    calibrate_bucket,
    has_plateaued,
    knee,
    load_calibration,
)
from worker.execution.executor import Executor, resolve_device
from worker.models.base import Prepared
from worker.policy.governor import MemoryReading
from worker.settings import load_settings

ROOT = REPO_ROOT


def test_knee_is_the_smallest_size_near_the_best_throughput() -> None:
    assert knee({1: 10, 2: 19, 4: 30, 8: 33, 16: 34, 32: 31}) == 8
    assert knee({1: 10, 2: 9}) == 1


def test_a_plateau_is_two_growth_steps_that_add_little() -> None:
    assert has_plateaued({1: 10, 2: 20, 4: 20.5, 8: 21})
    assert not has_plateaued({1: 10, 2: 20, 4: 30})
    assert not has_plateaued({1: 10, 2: 10})


def test_batch_sizes_double_up_to_both_caps() -> None:
    assert batch_sizes(32, 8192, 256) == [1, 2, 4, 8, 16, 32]
    assert batch_sizes(32, 8192, 512) == [1, 2, 4, 8, 16]
    assert batch_sizes(20, 10**6, 16) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(32, 100, 256) == [1]


def pressure_executor(max_padded_tokens: int) -> Executor:
    model = PressureModel(max_padded_tokens)
    model.load(resolve_device("cpu"))
    return Executor(model, resolve_device("cpu"))


def test_the_sweep_stops_at_out_of_memory_and_keeps_what_fitted() -> None:
    calibration = calibrate_bucket(pressure_executor(100), FixedMemory(MemoryReading(1, 100)), 0,
                                   Prepared(16, "x"), [1, 2, 4, 8, 16], repeats=1,
                                   high_watermark=0.9)
    assert calibration.stopped == "out_of_memory"  # 8 x 16 = 128 padded tokens > 100
    assert set(calibration.throughput) == {1, 2, 4}
    assert calibration.batch_size in {1, 2, 4}


def test_the_sweep_stops_at_the_high_watermark_without_keeping_that_size() -> None:
    calibration = calibrate_bucket(pressure_executor(1000), FixedMemory(MemoryReading(95, 100)),
                                   0, Prepared(16, "x"), [1, 2, 4], repeats=1,
                                   high_watermark=0.9)
    assert (calibration.stopped, calibration.batch_size, calibration.throughput) == \
        ("memory", 1, {})


def test_calibrate_writes_the_file_the_worker_loads(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker", "calibrate", "--model", "echo", "--device", "cpu",
         "--dtype", "float32",
         "--repeats", "1", "--calibration-dir", str(tmp_path), "--bucket-boundaries", "[64, 256]",
         "--max-batch-size", "8", "--log-level", "error"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "echo-cpu-float32.json"
    assert f"wrote {path}" in done.stdout
    document = json.loads(path.read_text())
    assert [b["max_length"] for b in document["buckets"]] == [64, 256]
    sizes = load_calibration(path)
    assert sizes is not None and set(sizes) == {64, 256}
    assert all(1 <= size <= 8 for size in sizes.values())


def test_the_worker_starts_with_calibrated_sizes_and_warms_each_bucket(
        tmp_path: Path, redis_url: str, r: redis.Redis) -> None:
    (tmp_path / "pressuremodel-cpu-float32.json").write_text(json.dumps(
        {"buckets": [{"max_length": 64, "batch_size": 2}]}))
    settings = load_settings(None, redis_url=redis_url,
                             model="tests.rigs.plugin_models:PressureModel",
                             bucket_boundaries=[64, 256], max_batch_size=4, metrics_port=0,
                             calibration_dir=tmp_path, merge_tokens=0, dtype="float32")
    worker = build_worker(settings, r)
    assert [cap.requests for cap in worker.governor.base] == [2, 4, 4]
    model = worker.model
    assert isinstance(model, PressureModel)
    assert model.batch_tokens == [2 * 64, 4 * 256]  # each bounded bucket's largest shape


def test_a_malformed_calibration_file_stops_the_worker_clearly(
        tmp_path: Path, redis_url: str, r: redis.Redis) -> None:
    (tmp_path / "echo-cpu-float32.json").write_text("{not json")
    settings = load_settings(None, redis_url=redis_url, model="echo", metrics_port=0,
                             calibration_dir=tmp_path, dtype="float32")
    with pytest.raises(StartupError, match="malformed"):
        build_worker(settings, r)


@pytest.fixture
def modelled_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed run reads the time the model was asked to take, not the clock: a busy
    host's late wake-ups (CI saw 10 ms) would move a fit from real sleeps past any bound."""

    def modelled(run: Callable[[], object]) -> float:
        run()
        return CostModel.modelled_s[-1]

    monkeypatch.setattr(calibration, "timed", modelled)


@pytest.mark.usefixtures("modelled_time")
def test_warm_up_measures_how_much_padding_a_merge_may_add(redis_url: str,
                                                           r: redis.Redis) -> None:
    """60 ms per batch and 1.5 ms per padded token: a batch is worth 40 padded tokens."""
    settings = load_settings(None, redis_url=redis_url, model="tests.rigs.plugin_models:CostModel",
                             model_options={"fixed_ms": 60.0, "per_token_ms": 1.5},
                             bucket_boundaries=[8, 64], max_batch_size=16, metrics_port=0)
    worker = build_worker(settings, r)
    assert worker.batcher.merge_tokens == 40


def test_merge_tokens_set_by_hand_is_kept(redis_url: str, r: redis.Redis) -> None:
    settings = load_settings(None, redis_url=redis_url, model="tests.rigs.plugin_models:CostModel",
                             bucket_boundaries=[8, 64], max_batch_size=8, metrics_port=0,
                             merge_tokens=7)
    assert build_worker(settings, r).batcher.merge_tokens == 7


@pytest.mark.usefixtures("modelled_time")
def test_with_a_latency_target_the_warm_up_fits_the_service_time_model(
        redis_url: str, r: redis.Redis) -> None:
    """The first requests are admitted, or shed, on measured costs, not on a zero fit
    (a cold worker would otherwise admit a whole burst it cannot serve in time). Without
    a target the model is not fitted: its prior of 1 ms stays."""
    settings = load_settings(None, redis_url=redis_url, model="tests.rigs.plugin_models:CostModel",
                             model_options={"fixed_ms": 60.0, "per_token_ms": 1.5},
                             bucket_boundaries=[8, 64], max_batch_size=16, metrics_port=0,
                             latency_target_ms=500)
    policy = build_worker(settings, r).intake.targeted.policy
    assert policy.model.predict_ms(0, 1, 8) > 60.0  # at the target percentile, not the mean
    assert policy.model.fit(0).fixed == pytest.approx(60.0, rel=0.2)
    without = load_settings(None, redis_url=redis_url, model="tests.rigs.plugin_models:CostModel",
                            bucket_boundaries=[8, 64], max_batch_size=16, metrics_port=0)
    assert build_worker(without, r).intake.targeted.policy.model.predict_ms(0, 1, 8) < 60.0


@pytest.mark.usefixtures("modelled_time")
def test_the_warm_up_seeds_every_bucket_with_warm_runs_only(redis_url: str,
                                                           r: redis.Redis) -> None:
    """Each shape's first run pays 400 ms more (cold): were it observed, the fit would
    predict every request late. Bucket 0 gets its warm-up's warm run and the merge
    measurement's last two runs of each shape; bucket 1 its warm-up's warm run."""
    settings = load_settings(None, redis_url=redis_url, model="tests.rigs.plugin_models:CostModel",
                             model_options={"fixed_ms": 60.0, "per_token_ms": 1.5,
                                            "cold_ms": 400.0},
                             bucket_boundaries=[8, 64], max_batch_size=16, metrics_port=0,
                             latency_target_ms=500)
    model = build_worker(settings, r).intake.targeted.policy.model
    assert [fit.count for fit in model.fits[:2]] == [5, 1]
    assert model.fit(0).fixed == pytest.approx(60.0, rel=0.2)
    assert model.mean_ms(1, 16, 64) == pytest.approx(60.0 + 1.5 * 16 * 64, rel=0.2)
