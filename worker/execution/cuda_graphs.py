"""CUDA graphs for an encoder's forward: captured per shape at warm-up, replayed per batch.

A small encoder's batch on a large GPU is a few hundred short kernels, each launched from
Python: the launches, not the arithmetic, bound it. A CUDA graph launches them all at once.
It replays a fixed shape from fixed buffers, so the forward is captured once per (batch-size
class, bucket length) that policy/shape_classes.py chooses, from static input buffers, all
graphs drawing on one memory pool. A batch is copied into the smallest shape that holds it
(its rows padded, its tokens zero-padded), the graph replayed, and the real rows of the
output returned; any other shape runs eagerly. A model opts in with `graph_capturable`
(models/base.py). Without CUDA nothing is captured: the worker logs one line and runs eagerly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from worker.models.base import Model
from worker.observe import metrics
from worker.policy.shape_classes import ShapeClasses, shape_classes

log = structlog.get_logger("redbatch.cuda_graphs")
Shape = tuple[int, int]  # (rows, length)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture: lazy initialisation settles
HALF_TOLERANCE = 2e-2  # replay against eager, float16/bfloat16 (a padded shape sums differently)
FLOAT_TOLERANCE = 1e-4


class RunsForward(Protocol):
    """An executor: it replays `graphs` in place of the model's forward (executor.py)."""

    graphs: Callable[[Any], Any] | None


@dataclass(slots=True)
class StaticShape:
    """One captured shape: the buffers its graph reads and writes, and its replay."""

    inputs: dict[str, torch.Tensor]  # (rows, length) each, on the device
    output: torch.Tensor  # one row per input row
    replay: Callable[[], None]


class GraphedForward:
    """`forward` with the captured shapes replayed; shared by the model instances, whose
    replays take turns (on the GPU too: a replay waits for the last one's output copy)."""

    def __init__(self, forward: Callable[[Any], Any], classes: ShapeClasses,
                 shapes: Mapping[Shape, StaticShape], device: torch.device) -> None:
        self.forward = forward
        self.classes = classes
        self.shapes = dict(shapes)
        self._turn = threading.Lock()
        self._free = torch.cuda.Event() if device.type == "cuda" else None
        self.replays = 0
        self.eager = 0

    def __call__(self, batch: Any) -> Any:
        static = self.static_for(batch)
        if static is None:
            self.eager += 1
            metrics.CUDA_GRAPH_BATCHES.labels("eager").inc()
            return self.forward(batch)
        with self._turn:
            if self._free is not None:  # the buffers are free once the last output is copied
                torch.cuda.current_stream().wait_event(self._free)
            rows = fill(static.inputs, batch)
            static.replay()
            output = static.output[:rows].clone()  # the buffers are the next batch's
            if self._free is not None:
                self._free.record()
            self.replays += 1
        metrics.CUDA_GRAPH_BATCHES.labels("replayed").inc()  # per batch: gpu_check reads it
        return output

    def static_for(self, batch: Any) -> StaticShape | None:
        """The captured shape that holds `batch`: a mapping of (rows, length) tensors with
        the captured names; None: run it eagerly."""
        if not isinstance(batch, Mapping) or not batch:
            return None
        tensors = list(batch.values())
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors):
            return None
        rows, length = tensors[0].shape
        if any(t.shape != tensors[0].shape for t in tensors):
            return None
        shape = self.classes.fit(rows, length)
        static = self.shapes.get(shape) if shape is not None else None
        return static if static is not None and static.inputs.keys() == batch.keys() else None


def fill(buffers: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> int:
    """Copy each of `batch`'s tensors into the top-left corner of its buffer, zeroing the
    rest of its rows (padding); rows below keep earlier, valid inputs whose outputs are
    dropped. The batch's row count."""
    rows = 0
    for name, buffer in buffers.items():
        tensor = batch[name]
        rows, length = tensor.shape
        buffer[:rows, :length].copy_(tensor, non_blocking=True)
        buffer[:rows, length:].zero_()
    return rows


def static_batch(model: Model, device: torch.device, rows: int, length: int
                 ) -> dict[str, torch.Tensor] | None:
    """`rows` of the model's sample of `length`, collated, on the device; None when the
    model's sample is not that long (its inputs are cut shorter)."""
    sample = model.sample(length)
    if sample is None or sample.length != length:
        return None
    batch = model.collate([sample] * rows)
    if not isinstance(batch, Mapping) or any(
            not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows, length)
            for t in batch.values()):
        return None
    return {name: tensor.to(device) for name, tensor in batch.items()}


def capture_shape(model: Model, inputs: dict[str, torch.Tensor], device: torch.device,
                  pool: Any) -> StaticShape:
    """The model's forward on `inputs` captured as a graph (after eager runs on a side
    stream, as torch.cuda.graph asks: lazy initialisation must not be captured)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            model.forward(inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = model.forward(inputs)
    return StaticShape(inputs, output, graph.replay)


def capture_all(model: Model, device: torch.device, classes: ShapeClasses
                ) -> dict[Shape, StaticShape]:
    """Every shape of `classes` the model can fill, the largest first, in one memory pool."""
    pool = torch.cuda.graph_pool_handle()
    shapes: dict[Shape, StaticShape] = {}
    for rows, length in classes.shapes:
        inputs = static_batch(model, device, rows, length)
        if inputs is not None:
            shapes[rows, length] = capture_shape(model, inputs, device, pool)
    torch.cuda.synchronize(device)
    return shapes


def check_replay(graphed: GraphedForward, model: Model, device: torch.device) -> None:
    """A padded replay of mixed lengths gives eager's result (as the CPU trace is checked)."""
    shortest = graphed.classes.classes[0][0]
    lengths = sorted({shortest, max(2, shortest // 2), 2}, reverse=True)
    samples = [model.sample(length) for length in lengths]
    batch = model.collate([s for s in samples if s is not None])
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    if graphed.static_for(batch) is None:
        raise RuntimeError("no captured shape holds the check batch")
    replayed, eager = graphed(batch).float(), model.forward(batch).float()
    tolerance = FLOAT_TOLERANCE if model.dtype == torch.float32 else HALF_TOLERANCE
    difference = (replayed - eager).abs().max().item()
    if difference > tolerance:
        raise RuntimeError(f"replay differs from eager by {difference:.3g}")


def install(executors: Sequence[RunsForward], model: Model, device: torch.device,
            boundaries: Sequence[int], max_batch_size: int, max_batch_tokens: int,
            asked: bool = False) -> GraphedForward | None:
    """Capture the model's shapes and have every executor replay them; None (eager, one log
    line) without CUDA, for a model that cannot be captured, or when a capture fails.
    `asked`: the user set cuda_graphs, so a skip is worth an info line (else debug: the
    default on a CPU is not news)."""
    skipped = log.info if asked else log.debug
    if device.type != "cuda":
        skipped("cuda_graphs.skipped", reason=f"no CUDA device ({device}): running eagerly")
        return None
    if model.generative:  # its engine captures its own steps (execution/step_graphs.py)
        return None
    if not model.graph_capturable:
        skipped("cuda_graphs.skipped", reason="the model does not declare graph_capturable")
        return None
    classes = shape_classes(boundaries, max_batch_size, max_batch_tokens)
    if not classes.classes:
        log.info("cuda_graphs.skipped", reason="no bucket boundaries: no fixed shapes")
        return None
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            shapes = capture_all(model, device, classes)
            graphed = GraphedForward(model.forward, classes, shapes, device)
            check_replay(graphed, model, device)
    except Exception as exc:  # graphs only save launch time: serve eagerly, say why
        log.warning("cuda_graphs.failed", error=f"{type(exc).__name__}: {exc}",
                    hint="running eagerly; cuda_graphs = false skips the capture")
        return None
    for executor in executors:
        executor.graphs = graphed
    log.info("cuda_graphs.captured", shapes=len(shapes), lengths=[c[0] for c in classes.classes],
             largest=max(shapes, key=lambda s: s[0] * s[1], default=None),
             memory_mib=torch.cuda.memory_reserved(device) >> 20,
             seconds=round(time.perf_counter() - started, 2))
    return graphed
