"""`python -m worker calibrate`: time each bucket at growing batch sizes, write the best."""

from __future__ import annotations

import tempfile
from pathlib import Path

from worker.execution.calibration import (
    CalibrationError,
    calibrate,
    calibration_path,
    write_calibration,
)
from worker.execution.executor import Executor
from worker.execution.memory import memory_probe
from worker.model_loading import load_model
from worker.policy.device_defaults import default_boundaries, on_device
from worker.settings import Settings
from worker.startup_error import StartupError


def run_calibration(settings: Settings, repeats: int) -> int:
    """`python -m worker calibrate`: measure each bucket, write the file `run` will load."""
    writable_directory(settings.calibration_dir)  # before minutes of measuring, not after
    model, device = load_model(settings)
    settings = on_device(settings, device.type)  # a GPU's batch limits, as `run` has them
    boundaries = settings.bucket_boundaries
    if boundaries is None:
        boundaries = default_boundaries(model.default_bucket_boundaries, device.type)
    try:
        buckets = calibrate(Executor(model, device),
                            memory_probe(device, settings.memory_limit_bytes), boundaries,
                            settings.max_batch_size, settings.max_batch_tokens, repeats,
                            settings.memory_high_watermark)
    except CalibrationError as exc:
        raise StartupError(str(exc)) from None
    path = calibration_path(settings.calibration_dir, settings.model_name, device,
                            model.precision_name)
    write_calibration(path, settings.model_name, device, buckets, repeats=repeats,
                      dtype=model.precision_name,
                      max_batch_size=settings.max_batch_size,
                      max_batch_tokens=settings.max_batch_tokens)
    print(f"{'max_length':>10} {'batch_size':>10} {'stopped':>13}  items/s by batch size")
    for b in buckets:
        curve = " ".join(f"{size}:{value:.0f}" for size, value in b.throughput.items())
        print(f"{b.max_length:>10} {b.batch_size:>10} {b.stopped:>13}  {curve}")
    print(f"wrote {path}")
    return 0


def writable_directory(directory: Path) -> None:
    """Create `directory` if need be; refuse with one line when it cannot take a file."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise StartupError(f"calibration_dir {str(directory)!r} cannot take the calibration "
                           f"file: {exc.strerror or exc}") from None
