"""Model execution: choosing the device and running batches on it in three steps.

    stage   collate on the host, copy to the device on the copy stream   (host work + copy)
    launch  forward on the compute stream, results copied back async     (device work)
    finish  wait for the results' event, postprocess on the host

Split this way, the worker stages batch N+1 while batch N computes (double buffering).
`run` does the three in a row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.execution.devices import Lanes, Marker, PinnedStaging, map_tensors
from worker.models.base import Model, Prepared
from worker.policy.precision import Precision, choose_precision


def resolve_device(name: str) -> torch.device:
    """`auto` means the first CUDA device when one is present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def cpu_bf16_support() -> str | None:
    """The CPU's fast bf16 instructions, None: none. From torch's own checks (torch.cpu, the
    cpuinfo library oneDNN dispatches on), not /proc/cpuinfo: they say what torch will use."""
    checks = (("AMX tiles", "_is_amx_tile_supported"),
              ("AVX-512 BF16", "_is_avx512_bf16_supported"))
    for name, check in checks:
        probe = getattr(torch.cpu, check, None)
        if probe is not None and probe():
            return name
    return None


def device_precision(setting: str, device: torch.device,
                     generative: bool = False) -> Precision:
    """The `dtype` setting resolved for this device (policy/precision.py); on CUDA with TF32
    allowed, float32 matmuls use the tensor cores from here on (a process-wide switch)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    cpu_bf16 = cpu_bf16_support() if device.type == "cpu" else None
    precision = choose_precision(setting, device.type, capability, cpu_bf16, generative)
    if precision.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return precision


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name the settings, logs and file names use."""
    return str(dtype).removeprefix("torch.")


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=device.type == "cuda"))


def to_host(output: Any) -> Any:
    """Start copying every device tensor of `output` back; a non-blocking copy from CUDA
    lands in pinned memory, valid once the stream reaches the next event."""
    return map_tensors(output, lambda t: t.to("cpu", non_blocking=True) if t.is_cuda else t)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or an allocation failure reported some other way."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in message  # the CPU allocator
        or "CUDA error: out of memory" in message  # outside the caching allocator
        or "CUBLAS_STATUS_ALLOC_FAILED" in message)


@dataclass(slots=True)
class Staged:
    items: Sequence[Prepared]
    batch: Any  # on the device, or on its way there
    copy_started: Marker
    copied: Marker


@dataclass(slots=True)
class Launched:
    staged: Staged
    output: Any  # on the host, complete once `done` is reached
    compute_started: Marker
    done: Marker

    def timeline_ms(self) -> dict[str, float]:
        """Copy and compute intervals, in ms from the start of this batch's copy."""
        start = self.staged.copy_started
        return {"copy_start": 0.0, "copy_end": start.ms_until(self.staged.copied),
                "compute_start": start.ms_until(self.compute_started),
                "compute_end": start.ms_until(self.done)}


class Executor:
    """Runs a model's batches on one device, on its own streams when the device is CUDA."""

    def __init__(self, model: Model, device: torch.device, timing: bool = False) -> None:
        self.model = model
        self.device = device
        self.lanes = Lanes(device, timing)
        self.staging = PinnedStaging(pin=self.lanes.is_cuda)
        # the model's captured CUDA graphs, replayed in place of its forward (cuda_graphs.py)
        self.graphs: Callable[[Any], Any] | None = None

    def another(self) -> Executor:
        """One more executor for the same model and device, with its own streams and staging
        buffers: a second model instance that shares the weights (and the CUDA graphs)."""
        executor = Executor(self.model, self.device, self.lanes.timing)
        executor.graphs = self.graphs
        return executor

    def stage(self, items: Sequence[Prepared], bucket: int = 0) -> Staged:
        """Collate on the host and start the copy to the device."""
        host_batch = self.model.collate(items)
        with self.lanes.copying():
            copy_started = self.lanes.mark()
            batch = self._copy_in(host_batch, bucket)
            copied = self.lanes.mark()
        self.staging.release(copied)
        return Staged(items, batch, copy_started, copied)

    def launch(self, staged: Staged) -> Launched:
        """Queue the forward after the copy, and the copy of its output back to the host."""
        with self.lanes.computing():
            staged.copied.make_wait(self.lanes.compute_stream)
            compute_started = self.lanes.mark()
            with torch.inference_mode():
                output = (self.graphs or self.model.forward)(staged.batch)
                if self.lanes.is_cuda:  # elsewhere postprocess gets the output as it is
                    output = to_host(output)
            done = self.lanes.mark()
        return Launched(staged, output, compute_started, done)

    def finish(self, launched: Launched) -> list[Any]:
        """Wait for this batch's results only, and split them per item."""
        launched.done.synchronize()
        items = launched.staged.items
        with torch.inference_mode():
            results = self.model.postprocess(launched.output, items)
        if len(results) != len(items):
            raise RuntimeError(f"model returned {len(results)} results for {len(items)} inputs")
        return results

    def run(self, items: Sequence[Prepared], bucket: int = 0) -> list[Any]:
        """Collate, copy to the device, forward and postprocess one batch."""
        return self.finish(self.launch(self.stage(items, bucket)))

    def _copy_in(self, host_batch: Any, bucket: int) -> Any:
        if self.device.type == "cpu":  # collate leaves tensors on the host: nothing to move
            return host_batch
        if not self.lanes.is_cuda:
            return to_device(host_batch, self.device)
        leaf = itertools.count()

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != "cpu":
                return tensor
            pinned = self.staging.hold((bucket, next(leaf)), tensor)
            on_device = pinned.to(self.device, non_blocking=True)
            self.lanes.hand_to_compute(on_device)
            return on_device

        return map_tensors(host_batch, copy)
