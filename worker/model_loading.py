"""The model loaded for serving: created from the settings, on its device, in the dtype
they resolve to there (int8 only where the model has it), with its instances' threads set."""

from __future__ import annotations

import time

import structlog
import torch

from worker.execution.cores import available_cores
from worker.execution.executor import device_precision, resolve_device
from worker.models import Model, ModelLoadError, create_model
from worker.models.weights_cache import default_cache_dir
from worker.policy.layout import Layout, choose_layout
from worker.policy.precision import INT8, Precision, UnsupportedDtype
from worker.settings import Settings
from worker.startup_error import StartupError

log = structlog.get_logger("redbatch")


def load_model(settings: Settings) -> tuple[Model, torch.device]:
    """The model loaded on its device, in the dtype the settings resolve to there."""
    try:
        model = create_model(settings.model, settings.model_options)
    except ModelLoadError as exc:
        raise StartupError(str(exc), ("model",)) from None
    try:
        device = resolve_device(settings.device)
        precision = device_precision(settings.dtype, device, model.generative)
    except UnsupportedDtype as exc:
        raise StartupError(str(exc), ("dtype",)) from None
    except ValueError as exc:
        raise StartupError(str(exc), ("device",)) from None
    set_precision(model, precision)
    model.cache_dir = settings.cache_dir or default_cache_dir()
    torch.set_num_threads(resolve_layout(settings, model, device).threads)
    started = time.perf_counter()
    log.info("model.loading", model=settings.model, device=str(device))
    try:
        model.load(device)
    except Exception as exc:  # plugin code: any failure to load is a start-up error
        raise StartupError(f"cannot load model {settings.model!r}: "
                           f"{type(exc).__name__}: {exc}", ("model",)) from None
    log.info("model.loaded", model=settings.model, device=str(device), dtype=precision.describe(),
             why=precision.reason, seconds=round(time.perf_counter() - started, 2))
    return model, device


def resolve_layout(settings: Settings, model: Model, device: torch.device) -> Layout:
    """How many model instances this process runs, with how many torch threads."""
    return choose_layout(settings.instances, settings.torch_threads,
                         settings.cpu_cores or available_cores(), device.type == "cpu",
                         model.concurrent_forward)


def set_precision(model: Model, precision: Precision) -> None:
    """The resolved dtype onto the model before load(); int8 only where the model has it."""
    if precision.dtype == INT8:
        if not model.int8_capable:
            raise StartupError("dtype int8 is for the encoder kinds (minilm, encoder, "
                               "reranker); this model has no int8 path", ("dtype",))
        model.dtype, model.quantization = torch.float32, INT8
    else:
        model.dtype = getattr(torch, precision.dtype)
    model.dtype_reason = precision.reason
