"""`torch_threads` caps torch's intra-op threads; by default the cores are shared out among
the model instances and worker processes, so that none oversubscribe."""

from __future__ import annotations

import redis
import torch

from worker.app import build_worker
from worker.settings import load_settings, threads_per_instance
from worker.supervisor import child_settings


def test_torch_threads_setting_is_applied_when_the_worker_is_built(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        build_worker(load_settings(None, model="echo", torch_threads=1, metrics_port=0), r)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(default)


def test_zero_keeps_torchs_default(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    build_worker(load_settings(None, model="echo", metrics_port=0), r)
    assert torch.get_num_threads() == default


def test_instances_share_the_cores_unless_threads_are_set() -> None:
    assert threads_per_instance(0, default=8, instances=1) == 8
    assert threads_per_instance(0, default=8, instances=2) == 4
    assert threads_per_instance(0, default=8, instances=2, processes=2) == 2
    assert threads_per_instance(0, default=2, instances=4) == 1  # never below one
    assert threads_per_instance(3, default=8, instances=2, processes=2) == 3  # as set


def test_two_instances_get_half_the_cores_each(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        build_worker(load_settings(None, model="echo", instances=2, metrics_port=0), r)
        assert torch.get_num_threads() == max(1, default // 2)
    finally:
        torch.set_num_threads(default)


def test_supervised_processes_share_the_cores() -> None:
    settings = load_settings(None, model="echo", processes=2, instances=2)
    children = child_settings(settings, "redis://h:1/0")
    expected = max(1, torch.get_num_threads() // 4)
    assert [child.torch_threads for child in children] == [expected, expected]
    assert all(child.instances == 2 for child in children)
