"""`torch_threads` caps torch's intra-op threads; by default the cores are shared out among
the model instances and worker processes, so that none oversubscribe. `instances = "auto"`
(the default) runs one single-threaded instance per core on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from worker.app import build_worker
from worker.execution.cores import available_cores
from worker.pipeline.worker import Worker
from worker.policy.layout import choose_layout
from worker.settings import load_settings
from worker.supervisor import child_settings


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    """Building a worker sets torch's thread count for the whole process: put it back."""
    default = torch.get_num_threads()
    yield
    torch.set_num_threads(default)


def build(r: redis.Redis, **settings: Any) -> Worker:
    return build_worker(load_settings(None, metrics_port=0, **{"model": "echo", **settings}), r)


def test_torch_threads_setting_is_applied_when_the_worker_is_built(r: redis.Redis) -> None:
    build(r, torch_threads=1)
    assert torch.get_num_threads() == 1


def test_one_instance_gets_every_core(r: redis.Redis) -> None:
    build(r, instances=1)
    assert torch.get_num_threads() == available_cores()


def test_auto_runs_one_single_threaded_instance_per_core(r: redis.Redis) -> None:
    worker = build(r)
    assert len(worker.runners) == available_cores()
    assert torch.get_num_threads() == 1


def test_auto_keeps_one_instance_for_a_model_that_does_not_declare_it(r: redis.Redis) -> None:
    worker = build(r, model="tests.rigs.plugin_models:SerialEcho")
    assert len(worker.runners) == 1
    assert torch.get_num_threads() == available_cores()


def test_two_instances_get_half_the_cores_each(r: redis.Redis) -> None:
    build(r, instances=2)
    assert torch.get_num_threads() == max(1, available_cores() // 2)


def test_supervised_processes_share_the_cores() -> None:
    settings = load_settings(None, model="echo", processes=2, instances=2)
    children = child_settings(settings, "redis://h:1/0")
    share = max(1, available_cores() // 2)
    assert [child.cpu_cores for child in children] == [share, share]
    layouts = [choose_layout(c.instances, c.torch_threads, c.cpu_cores, True, True)
               for c in children]
    assert [(lay.instances, lay.threads) for lay in layouts] == [(2, max(1, share // 2))] * 2


def test_supervised_children_under_auto_lay_out_their_share() -> None:
    children = child_settings(load_settings(None, model="echo", processes=2), "redis://h:1/0")
    share = max(1, available_cores() // 2)
    layouts = [choose_layout(c.instances, c.torch_threads, c.cpu_cores, True, True)
               for c in children]
    assert [(lay.instances, lay.threads) for lay in layouts] == [(share, 1)] * 2
