"""`instances = "auto"`: how a process spends its cores, decided from counts alone, and the
cores read from the affinity and the cgroup quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.execution.cores import available_cores, cgroup_cpu_quota
from worker.policy.layout import AUTO, choose_layout, cores_from_quota, share_cores


def test_auto_on_a_cpu_runs_one_single_threaded_instance_per_core() -> None:
    layout = choose_layout(AUTO, 0, cores=4, on_cpu=True, concurrent_forward=True)
    assert (layout.instances, layout.threads) == (4, 1)


def test_auto_keeps_one_instance_for_a_model_not_safe_on_several_threads() -> None:
    layout = choose_layout(AUTO, 0, cores=4, on_cpu=True, concurrent_forward=False)
    assert (layout.instances, layout.threads) == (1, 4)
    assert "concurrent_forward" in layout.reason


def test_auto_on_cuda_is_two_instances_per_device_for_a_concurrent_model() -> None:
    layout = choose_layout(AUTO, 0, cores=16, on_cpu=False, concurrent_forward=True)
    assert (layout.instances, layout.threads) == (2, 16)
    assert "per device" in layout.reason


def test_auto_on_cuda_keeps_one_instance_for_a_model_not_safe_on_several_threads() -> None:
    layout = choose_layout(AUTO, 0, cores=16, on_cpu=False, concurrent_forward=False)
    assert layout.instances == 1


@pytest.mark.parametrize("instances, threads, cores, expected", [
    (1, 0, 8, (1, 8)), (2, 0, 8, (2, 4)), (4, 0, 2, (4, 1)), (2, 3, 8, (2, 3))])
def test_explicit_numbers_work_as_before(instances: int, threads: int, cores: int,
                                         expected: tuple[int, int]) -> None:
    layout = choose_layout(instances, threads, cores, on_cpu=True, concurrent_forward=True)
    assert (layout.instances, layout.threads) == expected


def test_set_threads_are_kept_under_auto() -> None:
    layout = choose_layout(AUTO, 2, cores=4, on_cpu=True, concurrent_forward=True)
    assert (layout.instances, layout.threads) == (4, 2)


@pytest.mark.parametrize("affinity, quota, period, cores", [
    (8, None, None, 8), (8, 200_000, 100_000, 2), (8, 150_000, 100_000, 2),
    (2, 400_000, 100_000, 2), (4, 50_000, 100_000, 1), (0, None, None, 1)])
def test_a_cgroup_quota_caps_the_affinity(affinity: int, quota: int | None,
                                          period: int | None, cores: int) -> None:
    assert cores_from_quota(affinity, quota, period) == cores


def test_processes_share_the_cores() -> None:
    assert [share_cores(8, n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]


def test_the_quota_is_read_from_cgroup_v2_then_v1(tmp_path: Path) -> None:
    v2, quota, period = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    v2.write_text("150000 100000\n")
    assert cgroup_cpu_quota(v2, quota, period) == (150_000, 100_000)
    v2.write_text("max 100000\n")
    assert cgroup_cpu_quota(v2, quota, period) == (None, None)
    v2.unlink()
    quota.write_text("-1\n")
    period.write_text("100000\n")
    assert cgroup_cpu_quota(v2, quota, period) == (None, None)
    quota.write_text("300000\n")
    assert cgroup_cpu_quota(v2, quota, period) == (300_000, 100_000)


def test_available_cores_is_within_the_affinity() -> None:
    import os

    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))
