"""The baseline batch controllers (worker/policy/controllers.py), directly: the rules the
simulator's baselines and the worker's `batch_controller` share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from producer import Client
from worker.app import StartupError, assemble_worker
from worker.execution.executor import Executor, resolve_device
from worker.models import create_model
from worker.policy.batching import BatchLimits
from worker.policy.controllers import (
    AimdController,
    Controlled,
    ControlledCaps,
    DynamicTimeout,
    StepController,
    controlled,
    controller_from_settings,
    with_controlled,
)
from worker.settings import load_settings

TARGET_MS = 100.0


def test_aimd_grows_by_its_step_while_batches_are_under_the_target() -> None:
    aimd = AimdController(TARGET_MS, ceiling=32, step=2)
    assert aimd.limits == Controlled(1, 0.0)
    caps = [aimd.observe(20.0, [30.0]).max_batch_size for _ in range(5)]
    assert caps == [3, 5, 7, 9, 11]


def test_aimd_stops_at_its_ceiling() -> None:
    aimd = AimdController(TARGET_MS, ceiling=6, step=4)
    assert [aimd.observe(10.0, []).max_batch_size for _ in range(3)] == [5, 6, 6]


def test_aimd_cuts_by_a_tenth_when_the_batch_p99_is_over_the_target() -> None:
    aimd = AimdController(TARGET_MS, ceiling=32, step=2, window=50)
    for _ in range(15):
        aimd.observe(10.0, [])
    assert aimd.limits.max_batch_size == 31  # 1 + 15 x 2
    cap = aimd.observe(150.0, []).max_batch_size  # one slow batch: the p99 of 16 is over
    assert cap == int(31 * 0.9) == 27
    assert aimd.observe(10.0, []).max_batch_size == int(31 * 0.9 * 0.9)  # still in the window


def test_aimd_never_goes_below_one_and_keeps_the_configured_wait() -> None:
    aimd = AimdController(TARGET_MS, ceiling=32, max_wait_s=0.004)
    for _ in range(5):
        limits = aimd.observe(500.0, [])
    assert limits == Controlled(1, 0.004)


def test_aimd_forgets_slow_batches_past_its_window() -> None:
    aimd = AimdController(TARGET_MS, ceiling=32, window=3)
    aimd.observe(500.0, [])
    for _ in range(3):
        aimd.observe(10.0, [])
    assert aimd.limits.max_batch_size == 3  # cut while the slow batch was in, then grew


def test_step_starts_at_half_the_ceiling_and_grows_by_two_under_0_7_t() -> None:
    step = StepController(TARGET_MS, ceiling=20)
    assert step.limits.max_batch_size == 10
    assert step.observe(10.0, [69.0]).max_batch_size == 12
    assert [step.observe(10.0, [10.0]).max_batch_size for _ in range(5)] == [14, 16, 18, 20, 20]


def test_step_holds_between_the_bands() -> None:
    step = StepController(TARGET_MS, ceiling=32)
    assert step.observe(10.0, [70.0, 119.0]).max_batch_size == 16
    assert step.observe(10.0, [120.0]).max_batch_size == 16  # 1.2 x T itself: not above


def test_step_shrinks_by_two_over_1_2_t_down_to_one() -> None:
    step = StepController(TARGET_MS, ceiling=6)
    assert step.limits.max_batch_size == 3
    assert step.observe(10.0, [121.0]).max_batch_size == 1
    assert step.observe(10.0, [50.0]).max_batch_size == 1  # the p99 of the window is still over


def test_step_reads_the_p99_of_its_window_of_latencies() -> None:
    step = StepController(TARGET_MS, ceiling=32, window=100)
    step.observe(10.0, [10.0] * 99 + [500.0])  # p99 of 100 by nearest rank: the slowest
    assert step.limits.max_batch_size == 14
    step.observe(10.0, [10.0] * 100)  # the 500 ms left the window
    assert step.limits.max_batch_size == 16


def test_dynamic_timeout_waits_twice_the_mean_latency() -> None:
    timeout = DynamicTimeout(ceiling=32)
    assert timeout.limits == Controlled(32, 0.010)
    assert timeout.observe(5.0, [20.0, 40.0]).max_wait_s == pytest.approx(0.060)
    assert timeout.observe(5.0, [90.0]).max_wait_s == pytest.approx(2 * 50.0 / 1000)


def test_dynamic_timeout_never_waits_under_its_floor() -> None:
    timeout = DynamicTimeout(ceiling=8, floor_ms=10.0)
    assert timeout.observe(1.0, [2.0, 3.0]).max_wait_s == pytest.approx(0.010)
    assert timeout.observe(1.0, []).max_batch_size == 8


def test_dynamic_timeout_averages_over_its_window() -> None:
    timeout = DynamicTimeout(ceiling=8, window=2)
    timeout.observe(1.0, [1000.0])
    assert timeout.observe(1.0, [30.0, 30.0]).max_wait_s == pytest.approx(0.060)


def test_the_controlled_cap_never_exceeds_the_governors() -> None:
    governor = {0: BatchLimits(32, 8192, 0.005), 1: BatchLimits(4, 512, 0.005)}
    aimd = AimdController(TARGET_MS, ceiling=32)
    caps = ControlledCaps(governor.__getitem__, aimd)
    assert caps(0).max_batch_size == 1 and caps(0).max_batch_tokens == 8192
    for _ in range(5):
        aimd.observe(10.0, [])
    assert caps(0).max_batch_size == 11
    assert caps(1) is governor[1]  # the governor's cap is the lower: it holds


def test_with_controlled_sets_the_cap_and_the_wait_only() -> None:
    limits = with_controlled(BatchLimits(32, 4096, 0.005), Controlled(7, 0.040))
    assert limits == BatchLimits(7, 4096, 0.040)


def test_the_batcher_gets_controlled_limits_only_with_a_controller() -> None:
    limits = BatchLimits(32, 4096, 0.005)

    def provider(bucket: int) -> BatchLimits:
        return limits

    assert controlled(limits, provider, None) == (limits, provider)
    batcher_limits, caps = controlled(limits, provider, StepController(TARGET_MS, 32))
    assert batcher_limits == BatchLimits(16, 4096, 0.0) and caps(0).max_batch_size == 16


@pytest.mark.parametrize("kind, expected, cap, wait_s", [
    ("aimd", AimdController, 1, 0.0),
    ("step", StepController, 8, 0.0),
    ("dynamic_timeout", DynamicTimeout, 16, 0.010),
])
def test_the_worker_setting_builds_the_controller(kind: str, expected: type, cap: int,
                                                  wait_s: float) -> None:
    target = {"controller_target_ms": 80.0} if kind != "dynamic_timeout" else {}
    settings = load_settings(batch_controller=kind, max_batch_size=16, max_wait_ms=0, **target)
    controller = controller_from_settings(settings)
    assert isinstance(controller, expected)
    assert controller is not None and controller.limits.max_batch_size == cap
    assert controller.limits.max_wait_s == pytest.approx(wait_s)


def test_static_batching_has_no_controller() -> None:
    assert controller_from_settings(load_settings()) is None


# --- end to end: a worker with `batch_controller`, through Redis, on the echo cost model ---

def batch_sizes(redis_url: str, worker_factory: Callable[..., Any], count: int,
                **settings: Any) -> list[int]:
    """Each request's batch size, in arrival order, for a backlog sent before the worker
    starts (its first read takes it all, so every batch leaves at the controller's cap)."""
    client = Client(redis_url, "echo")
    ids = client.submit_many([{"n": i} for i in range(count)])
    time.sleep(0.1)  # the backlog is already late for the step controller's target
    with worker_factory(model_options={"delay_ms": 10, "per_item_ms": 1}, instances=1,
                        max_wait_ms=0, **settings):
        envelopes = [client.wait(i, timeout=30) for i in ids]
    assert all(e["ok"] for e in envelopes)
    return [e["meta"]["batch_size"] for e in envelopes]


def runs(sizes: list[int]) -> list[int]:
    """The batches' sizes, from each request's (the backlog runs in order, one bucket)."""
    batches, index = [], 0
    while index < len(sizes):
        batches.append(sizes[index])
        index += sizes[index]
    return batches


def test_an_aimd_worker_grows_its_batch_cap_from_one(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    sizes = batch_sizes(redis_url, worker_factory, 200, batch_controller="aimd",
                        controller_target_ms=500.0)
    # the compute loop takes batch N+1 while batch N runs, so a cap moves one batch later
    assert runs(sizes)[:14] == [1, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25]
    assert REGISTRY.get_sample_value("redbatch_controller_limit",
                                     {"model": "echo", "limit": "max_batch_size"}) == 32


def test_a_step_worker_cuts_its_batch_cap_by_two_over_the_target(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    sizes = batch_sizes(redis_url, worker_factory, 100, batch_controller="step",
                        controller_target_ms=50.0)
    assert runs(sizes)[:10] == [16, 16, 14, 12, 10, 8, 6, 4, 2, 1]


def test_a_dynamic_timeout_worker_waits_twice_its_mean_latency(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    sizes = batch_sizes(redis_url, worker_factory, 40, batch_controller="dynamic_timeout")
    assert runs(sizes) == [32, 8]  # the cap stays at max_batch_size
    wait_s = REGISTRY.get_sample_value("redbatch_controller_limit",
                                       {"model": "echo", "limit": "max_wait_seconds"})
    assert wait_s is not None and wait_s >= 2 * 0.1  # each waited the backlog's 100 ms at least


def test_a_generative_model_refuses_a_controller_at_start() -> None:
    model = create_model("echo", {})
    model.generative = True  # the check comes before anything generative is built
    settings = load_settings(model="echo", batch_controller="dynamic_timeout", metrics_port=0)
    with pytest.raises(StartupError, match="batch_controller applies to batch models"):
        assemble_worker(settings, model, Executor(model, resolve_device("cpu")),
                        client=None)  # type: ignore[arg-type]
