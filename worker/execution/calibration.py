"""Timing the model on synthetic batches: warm-up before serving, and `python -m worker calibrate`.

Warm-up runs every bucket's largest allowed shape once, so the first real request pays for
neither kernel selection nor allocator growth. Calibration times each bucket at growing
batch sizes and keeps the size past which throughput stops growing meaningfully: bigger
batches would only add latency and memory. Its result is a JSON file keyed by model and
device, loaded by the worker at start.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import structlog
import torch

from worker.execution.executor import Executor, is_out_of_memory
from worker.execution.guarded_runner import BatchRunner
from worker.execution.memory import MemoryProbe
from worker.models.base import Model, Prepared

log = structlog.get_logger("redbatch.calibration")

PLATEAU_GAIN = 0.05  # a doubling that adds less throughput than this is not worth its latency
KNEE_TOLERANCE = 0.10  # pick the smallest size within this of the best throughput


class CalibrationError(Exception):
    """A calibration file cannot be used; the message is for the user."""


# --- the file ---------------------------------------------------------------------------------

def device_key(device: torch.device) -> str:
    """`cpu`, or `cuda-<gpu name>`: a calibration only holds for the hardware it ran on."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def calibration_path(directory: Path, model_name: str, device: torch.device,
                     dtype: str) -> Path:
    """A calibration holds for one device and one dtype (bfloat16 batches cost less)."""
    return directory / f"{model_name}-{device_key(device)}-{dtype}.json"


def calibrated_sizes(path: Path) -> dict[int, int] | None:
    """load_calibration, logged: what the worker starts with (CalibrationError: unusable)."""
    sizes = load_calibration(path)
    if sizes is None:
        log.debug("calibration.none", path=str(path), hint="python -m worker calibrate")
    else:
        log.info("calibration.loaded", path=str(path), batch_sizes=sizes)
    return sizes


def load_calibration(path: Path) -> dict[int, int] | None:
    """Best batch size per bucket boundary, or None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {int(b["max_length"]): int(b["batch_size"]) for b in data["buckets"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(f"calibration file {path} is malformed ({exc!r}); "
                               "delete it or run `python -m worker calibrate` again") from None


@dataclass(slots=True)
class BucketCalibration:
    max_length: int
    batch_size: int
    stopped: str  # why the sweep ended: plateau, memory, out_of_memory or limit
    throughput: dict[int, float]  # batch size -> items per second


def write_calibration(path: Path, model_name: str, device: torch.device,
                      buckets: Sequence[BucketCalibration], **context: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"model": model_name, "device": device_key(device),
                "created": datetime.now(UTC).isoformat(timespec="seconds"), **context,
                "buckets": [asdict(b) for b in buckets]}
    path.write_text(json.dumps(document, indent=2) + "\n")


# --- the policy -------------------------------------------------------------------------------

def knee(throughput: Mapping[int, float], tolerance: float = KNEE_TOLERANCE) -> int:
    """The smallest batch size whose throughput is within `tolerance` of the best."""
    best = max(throughput.values())
    return min(size for size, value in throughput.items() if value >= (1 - tolerance) * best)


def has_plateaued(throughput: Mapping[int, float], gain: float = PLATEAU_GAIN) -> bool:
    """The last two growth steps each added less than `gain`."""
    values = [throughput[size] for size in sorted(throughput)]
    return len(values) >= 3 and all(later < (1 + gain) * earlier
                                    for earlier, later in pairwise(values[-3:]))


def batch_sizes(max_batch_size: int, max_batch_tokens: int, length: int) -> list[int]:
    """1, 2, 4, ... up to both caps, ending with the largest allowed size."""
    largest = max(1, min(max_batch_size, max_batch_tokens // length))
    sizes = [1 << i for i in range(largest.bit_length()) if 1 << i < largest]
    return [*sizes, largest]


# --- measuring --------------------------------------------------------------------------------

def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def seconds_per_batch(run: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` runs, after one untimed run: other load only ever adds time."""
    run()
    return min(timed(run) for _ in range(repeats))


def calibrate_bucket(executor: Executor, memory: MemoryProbe, bucket: int, sample: Prepared,
                     sizes: Sequence[int], repeats: int,
                     high_watermark: float) -> BucketCalibration:
    throughput: dict[int, float] = {}
    stopped = "limit"
    for size in sizes:
        items = [sample] * size
        memory.before_batch()
        try:
            seconds = seconds_per_batch(lambda: executor.run(items, bucket), repeats)  # noqa: B023
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            stopped = "out_of_memory"
        else:
            log.info("calibrate.measured", max_length=sample.length, batch_size=size,
                     items_per_s=round(size / seconds, 1))
            if memory.read().fraction >= high_watermark:
                stopped = "memory"  # serving this size would only make the governor cut it
            else:
                throughput[size] = size / seconds
                if has_plateaued(throughput):
                    stopped = "plateau"
        if stopped != "limit":
            break
    if stopped == "out_of_memory":
        memory.release_cache()
    if not throughput:
        return BucketCalibration(sample.length, 1, stopped, {})
    return BucketCalibration(sample.length, knee(throughput), stopped, throughput)


def calibrate(executor: Executor, memory: MemoryProbe, boundaries: Sequence[int],
              max_batch_size: int, max_batch_tokens: int, repeats: int,
              high_watermark: float) -> list[BucketCalibration]:
    """One calibration per bounded bucket (the open-ended last bucket has no shape)."""
    results = []
    for bucket, length in enumerate(boundaries):
        sample = executor.model.sample(length)
        if sample is None:
            raise CalibrationError("this model has no sample(); it cannot be calibrated")
        sizes = batch_sizes(max_batch_size, max_batch_tokens, sample.length)
        results.append(calibrate_bucket(executor, memory, bucket, sample, sizes, repeats,
                                        high_watermark))
    return results


Observe = Callable[[int, int, int, float], None]  # (bucket, size, longest, ms) of a run


def warm_up(runner: BatchRunner, model: Model, boundaries: Sequence[int],
            observe: Observe | None = None) -> None:
    """Run each bucket's largest allowed shape once. One info line says what it cost in all;
    each bucket's own line is at debug level. With `observe` (a latency target's model),
    each shape runs once more and only that warm run is observed: a shape's first run is
    cold, and a fit seeded by an outlier would predict every request late."""
    started = time.perf_counter()
    sizes: list[int] = []
    for bucket, length in enumerate(boundaries):
        sample = model.sample(length)
        if sample is None:
            log.info("warmup.skipped", reason="the model has no sample()")
            return
        cap = runner.governor.caps[bucket]
        items = [sample] * max(1, min(cap.requests, cap.tokens // sample.length))
        try:
            seconds = _warm_bucket(runner, bucket, items, observe)
        except Exception:  # warm-up only saves time: serve anyway, the error will show again
            log.exception("warmup.failed", bucket=bucket, max_length=sample.length)
            continue
        sizes.append(len(items))
        log.debug("warmup.bucket", bucket=bucket, max_length=sample.length,
                  batch_size=len(items), ms=round(seconds * 1000, 1))
    log.info("warmup.done", buckets=len(sizes), batch_size=max(sizes, default=0),
             seconds=round(time.perf_counter() - started, 2))


def _warm_bucket(runner: BatchRunner, bucket: int, items: list[Any],
                 observe: Observe | None) -> float:
    """Seconds of the shape's cold run; with `observe`, a warm run follows and is observed."""
    seconds = timed(lambda: runner.run(bucket, items))
    if observe is not None:
        _tell(observe, bucket, items, timed(lambda: runner.run(bucket, items)))
    return seconds


def measure_merge_tokens(runner: BatchRunner, model: Model, length: int,
                         repeats: int = 3, observe: Observe | None = None) -> int | None:
    """The model's fixed cost per batch, in padded tokens: how much padding a merge of two
    buckets into one batch may add and still pay (batching.py). Fitted from two timed shapes
    of the shortest bucket, one input and a full batch (medians); None without sample()."""
    sample = model.sample(length)
    if sample is None:
        return None
    cap = runner.governor.caps[0]
    size = max(2, min(cap.requests, cap.tokens // sample.length))
    one = statistics.median(_timed_runs(runner, [sample], repeats, observe))
    full = statistics.median(_timed_runs(runner, [sample] * size, repeats, observe))
    per_token = (full - one) / ((size - 1) * sample.length)
    fixed = one - per_token * sample.length
    if per_token <= 0:  # padding costs nothing measurable (echo, or a device far from full)
        return cap.tokens
    return round(min(cap.tokens, max(0.0, fixed / per_token)))


def _timed_runs(runner: BatchRunner, items: list[Any], repeats: int,
                observe: Observe | None) -> list[float]:
    """Seconds of each of `repeats` runs of bucket 0. All but the first are told to
    `observe` as well: the first may be the shape's cold run (one input is a new shape)."""
    times = [timed(lambda: runner.run(0, items)) for _ in range(repeats)]
    if observe is not None:
        for seconds in times[1:]:
            _tell(observe, 0, items, seconds)
    return times


def _tell(observe: Observe, bucket: int, items: list[Any], seconds: float) -> None:
    """Give `observe` one run of `items` in `bucket`, as the worker reports a served batch."""
    observe(bucket, len(items), max(item.length for item in items), seconds * 1000)

