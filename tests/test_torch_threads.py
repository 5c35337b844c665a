"""`torch_threads` caps torch's intra-op threads, leaving cores for reading and replying."""

from __future__ import annotations

import redis
import torch

from worker.app import build_worker
from worker.settings import load_settings


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
