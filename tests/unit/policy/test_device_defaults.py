"""Defaults that suit the device (policy/device_defaults.py): a GPU's batch limits and
buckets where the user set none; a CPU's defaults exactly as they were."""

from __future__ import annotations

from worker.models.minilm import MiniLMModel
from worker.policy.device_defaults import (
    CUDA_BATCH_DEFAULTS,
    default_boundaries,
    device_defaults,
    on_device,
    thinned,
)
from worker.settings import exported, load_settings

CPU_DEFAULTS = {"max_batch_size": 32, "max_batch_tokens": 8192, "max_inflight": 512}


def limits_of(settings: object) -> dict[str, int]:
    return {name: getattr(settings, name) for name in CPU_DEFAULTS}


def test_a_cpu_keeps_the_settings_defaults_exactly() -> None:
    settings = load_settings(None)
    assert limits_of(settings) == CPU_DEFAULTS
    assert on_device(settings, "cpu") is settings
    assert device_defaults("cpu", set()) == {}
    assert default_boundaries(MiniLMModel.default_bucket_boundaries, "cpu") == \
        list(MiniLMModel.default_bucket_boundaries)


def test_cuda_batches_by_a_token_budget_of_large_batches() -> None:
    resolved = on_device(load_settings(None), "cuda")
    assert limits_of(resolved) == {"max_batch_size": 512, "max_batch_tokens": 65_536,
                                   "max_inflight": 4096}
    assert on_device(resolved, "cuda") == resolved  # applying it again changes nothing


def test_batch_jobs_take_a_larger_share_of_a_gpu_than_of_cpu_cores() -> None:
    """On a CPU the gateway and Redis share the cores: at 0.25 the online p99 grew x1.2-1.3
    beside a batch (bench.batches), at 0.1 x1.04-1.24; 4 rows a batch x1.10-1.24, 2 rows
    x1.04-1.10."""
    assert load_settings(None).background_share == 0.1
    assert on_device(load_settings(None), "cuda").background_share == 0.25
    assert on_device(load_settings(None, background_share=0.5), "cuda").background_share == 0.5
    assert load_settings(None).background_rows == 2
    assert on_device(load_settings(None), "cuda").background_rows == 4
    assert on_device(load_settings(None, background_rows=1), "cuda").background_rows == 1


def test_a_setting_the_user_set_is_kept_on_cuda() -> None:
    resolved = on_device(load_settings(None, max_batch_size=32, max_inflight=100), "cuda")
    assert limits_of(resolved) == {"max_batch_size": 32, "max_batch_tokens": 65_536,
                                   "max_inflight": 100}


def test_a_child_process_resolves_the_device_defaults_itself() -> None:
    """The supervisor hands settings down as text: an unset device default must stay unset,
    or a CUDA child would get the CPU's 32."""
    texts = exported(load_settings(None, max_batch_tokens=1000))
    assert texts["max_batch_tokens"] == "1000"
    assert not {"max_batch_size", "max_inflight", "cuda_graphs"} & texts.keys()
    assert set(CUDA_BATCH_DEFAULTS) == {"max_batch_size", "max_batch_tokens", "max_inflight",
                                        "background_share", "background_rows"}
    assert not {"background_share", "background_rows"} & texts.keys()
    assert exported(load_settings(None, cuda_graphs=False))["cuda_graphs"] == "false"


def test_cuda_buckets_are_the_models_thinned_to_steps_of_one_and_a_half() -> None:
    assert default_boundaries(MiniLMModel.default_bucket_boundaries, "cuda") == \
        [8, 12, 20, 32, 48, 80, 128, 192, 256]
    assert thinned([16, 32, 64, 128, 256], 1.5) == [16, 32, 64, 128, 256]
    assert thinned([10, 11, 12, 13], 1.5) == [10, 13]  # the last boundary is always kept
    assert thinned([], 1.5) == []
