"""`torch_threads` caps torch's intra-op threads; by default the cores are shared out among
the model instances and worker processes, so that none oversubscribe. `instances = "auto"`
(the default) runs one single-threaded instance per core on a CPU."""

from __future__ import annotations

import redis
import torch

from worker.app import build_worker
from worker.execution.cores import available_cores
from worker.policy.layout import choose_layout
from worker.settings import load_settings
from worker.supervisor import child_settings


def test_torch_threads_setting_is_applied_when_the_worker_is_built(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        build_worker(load_settings(None, model="echo", torch_threads=1, metrics_port=0), r)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(default)


def test_one_instance_gets_every_core(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        build_worker(load_settings(None, model="echo", instances=1, metrics_port=0), r)
        assert torch.get_num_threads() == available_cores()
    finally:
        torch.set_num_threads(default)


def test_auto_runs_one_single_threaded_instance_per_core(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        worker = build_worker(load_settings(None, model="echo", metrics_port=0), r)
        assert len(worker.runners) == available_cores()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(default)


def test_auto_keeps_one_instance_for_a_model_that_does_not_declare_it(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        worker = build_worker(load_settings(None, model="tests.plugin_models:SerialEcho",
                                            metrics_port=0), r)
        assert len(worker.runners) == 1
        assert torch.get_num_threads() == available_cores()
    finally:
        torch.set_num_threads(default)


def test_two_instances_get_half_the_cores_each(r: redis.Redis) -> None:
    default = torch.get_num_threads()
    try:
        build_worker(load_settings(None, model="echo", instances=2, metrics_port=0), r)
        assert torch.get_num_threads() == max(1, available_cores() // 2)
    finally:
        torch.set_num_threads(default)


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
