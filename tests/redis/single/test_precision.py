"""The `dtype` setting (issue 31): the pure choice per device, the start-up refusal, what
the worker shows, and MiniLM's accuracy in bfloat16 on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
import torch.nn.functional as F

from tests.rigs.paths import REPO_ROOT
from tests.rigs.workers import loaded_model
from worker.app import StartupError, build_worker
from worker.execution.calibration import calibration_path
from worker.execution.executor import cpu_bf16_support
from worker.model_loading import load_model
from worker.models.minilm import MiniLMModel
from worker.policy.precision import Precision, UnsupportedDtype, choose_precision
from worker.settings import SettingsError, load_settings

SENTENCES = REPO_ROOT / "examples" / "sentences.txt"


@pytest.mark.parametrize(("setting", "device", "capability", "expected"), [
    ("auto", "cpu", None, ("float32", False)),  # no fast bf16 named: tests/unit/policy
    ("auto", "cuda", (9, 0), ("bfloat16", False)),  # H100 / H200
    ("auto", "cuda", (8, 0), ("bfloat16", False)),  # A100
    ("auto", "cuda", (7, 5), ("float16", False)),  # T4
    ("float32", "cuda", (9, 0), ("float32", True)),  # TF32 matmuls
    ("float32", "cuda", (7, 0), ("float32", False)),  # no TF32 before Ampere
    ("float32", "cpu", None, ("float32", False)),
    ("bfloat16", "cpu", None, ("bfloat16", False)),
    ("float16", "cuda", (7, 0), ("float16", False)),
    ("bfloat16", "cuda", (8, 6), ("bfloat16", False)),
])
def test_the_dtype_for_each_device(setting: str, device: str,
                                   capability: tuple[int, int] | None,
                                   expected: tuple[str, bool]) -> None:
    chosen = choose_precision(setting, device, capability)
    assert isinstance(chosen, Precision) and (chosen.dtype, chosen.tf32) == expected
    assert chosen.reason


@pytest.mark.parametrize(("setting", "capability", "message"), [
    ("bfloat16", (7, 5), "bfloat16 needs a CUDA device of compute capability 8.0"),
    ("float16", (5, 0), "float16 needs a CUDA device of compute capability 5.3"),
])
def test_a_dtype_the_gpu_cannot_run_is_refused_in_one_line(
        setting: str, capability: tuple[int, int], message: str) -> None:
    with pytest.raises(UnsupportedDtype, match=message) as refused:
        choose_precision(setting, "cuda", capability)
    assert "\n" not in str(refused.value)


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(UnsupportedDtype, match="dtype must be one of"):
        choose_precision("float64", "cpu")
    with pytest.raises(SettingsError, match="invalid setting 'dtype'"):
        load_settings(None, dtype="float64")


def test_calibration_files_are_keyed_by_device_and_dtype(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    assert calibration_path(tmp_path, "minilm", cpu, "bfloat16").name == \
        "minilm-cpu-bfloat16.json"
    assert calibration_path(tmp_path, "minilm", cpu, "float32") != \
        calibration_path(tmp_path, "minilm", cpu, "bfloat16")


def test_the_model_loads_in_the_chosen_dtype_and_the_worker_announces_it(
        redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    settings = load_settings(None, redis_url=redis_url, model="echo", dtype="bfloat16",
                             device="cpu", metrics_port=0, calibration_dir=tmp_path,
                             warmup=False)
    worker = build_worker(settings, r)
    assert worker.model.dtype == torch.bfloat16
    worker.maintenance.announce()
    from producer import protocol
    from worker.streams.queue_stats import announcement

    announced = r.hgetall(protocol.workers_key(settings.namespace, settings.model_name))
    assert [announcement(v)["dtype"] for v in announced.values()] == ["bfloat16"]
    assert [announcement(v)["dtype_why"] for v in announced.values()] == ["as set"]
    model, _ = load_model(load_settings(None, model="echo", device="cpu"))
    fast = cpu_bf16_support()  # auto on a CPU: bf16 with AMX / AVX-512 BF16 (issue 45)
    assert model.dtype == (torch.bfloat16 if fast else torch.float32)
    assert model.dtype_reason.startswith("auto:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only host")
def test_cuda_unavailable_is_still_a_one_line_start_up_error() -> None:
    with pytest.raises(StartupError, match="CUDA is not available"):
        load_model(load_settings(None, model="echo", device="cuda", dtype="bfloat16"))


def test_minilm_in_bfloat16_matches_float32_on_real_text() -> None:
    """Four dozen real sentences, mixed lengths, one padded batch: cosine >= 0.999 each."""
    texts = SENTENCES.read_text().splitlines()[:48]
    fp32 = loaded_model("minilm")
    bf16 = MiniLMModel()
    bf16.dtype = torch.bfloat16
    bf16.load(torch.device("cpu"))
    assert bf16.model.dtype == torch.bfloat16
    outputs = []
    for model in (fp32, bf16):
        items = [model.prepare({"text": text}, len(text)) for text in texts]
        with torch.inference_mode():
            outputs.append(model.forward(model.collate(items)))
    assert outputs[1].dtype == torch.float32  # pooled and sent back in float32
    cosine = F.cosine_similarity(outputs[0], outputs[1], dim=1)
    assert cosine.min().item() >= 0.999, cosine.min().item()
