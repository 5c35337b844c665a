"""CUDA graphs of the engine's steps, captured at start: a decode step per shape class, and a
step's packed prefill per (queries, keys) class.

A step of a small model on a large GPU is a thousand or more short kernels, each launched
from Python: the launches bound it, not the arithmetic (on an H200, SmolLM2-135M decoded at
159 tokens/s at batch 64 eagerly, and a packed prefill is some 8,000 operator calls). A
CUDA graph launches them all at once. The engine pads a step to a class
(policy/shape_classes.py: `decode_classes`, rows 1, 2, 4, ... up to max_seqs at contexts
256, 512, ... tokens; `prefill_classes`, 64, 128, ... new tokens up to the step's budget
over 64, 128, ... keys) in step_layouts.DecodeLayout or PackedLayout, whose every tensor has
a fixed shape per class and whose slots and masks are worked out on the device inside the
forward. So the forward is captured once per class from static buffers, all graphs drawing
on one memory pool; a step copies its inputs into its class's buffers and replays (shapes
past the largest class run eagerly). The KV pool's tensors never move, so the graphs write
and read them in place.

The smallest and largest capture of each kind is checked against the eager forward on other
inputs than it was captured with; any failure leaves the engine eager, with one log line
saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from worker.execution.kv_pool import KVPool
from worker.execution.paged_attention import Layout
from worker.execution.step_layouts import DecodeLayout, PackedLayout, StepLayout
from worker.policy.shape_classes import ShapeClasses

log = structlog.get_logger("redbatch.step_graphs")
Shape = tuple[int, int]  # decode: (rows, context length); prefill: (queries, keys)
GraphLayout = DecodeLayout | PackedLayout
WARMUP_RUNS = 2  # eager runs on a side stream before a capture: lazy initialisation settles
CHECK_SPREAD = 16  # the check's rows are 1..16 tokens long, on the trash block
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}  # logits


class Engine(Protocol):
    """What a capture needs of the engine (execution/generation.py)."""

    device: torch.device
    pool: KVPool
    max_seqs: int
    shapes: ShapeClasses
    prefills: ShapeClasses

    def logits(self, ids: torch.Tensor, layout: Any) -> torch.Tensor: ...


@dataclass(slots=True)
class StepGraph:
    """One class's graph: the static buffers it reads and the logits it writes."""

    ids: torch.Tensor  # [rows, queries]
    layout: GraphLayout  # bound to static buffers of its class's shape
    logits: torch.Tensor  # [rows, vocab]
    graph: Any  # torch.cuda.CUDAGraph

    def replay(self, ids: torch.Tensor, layout: GraphLayout) -> torch.Tensor:
        """Copy the step's inputs in, replay; the logits stay valid until the next replay."""
        self.ids.copy_(ids, non_blocking=True)
        for mine, theirs in zip(self.layout.bound, layout.bound, strict=True):
            mine.copy_(theirs, non_blocking=True)
        self.graph.replay()
        return self.logits


class StepGraphs:
    def __init__(self, decode: dict[Shape, StepGraph],
                 prefill: dict[Shape, StepGraph] | None = None) -> None:
        self.decode, self.prefill = decode, prefill or {}
        self.replays = {"decode": 0, "prefill": 0}

    def replay(self, ids: torch.Tensor, layout: Layout) -> torch.Tensor | None:
        """The logits of the graph of the layout's class, replayed on the step's inputs;
        None when the layout is not padded to a captured class (run it eagerly)."""
        if isinstance(layout, StepLayout) or layout.shape is None:
            return None
        kind = "decode" if isinstance(layout, DecodeLayout) else "prefill"
        graph = getattr(self, kind).get(layout.shape)
        if graph is None:
            return None
        self.replays[kind] += 1
        return graph.replay(ids, layout)

    @classmethod
    def capture(cls, engine: Engine) -> StepGraphs | None:
        """Every decode and prefill class, the largest first, in one memory pool; None (and
        one log line) without CUDA or when a capture fails or disagrees with the eager
        forward."""
        if engine.device.type != "cuda":  # the worker said so at start (cuda_graphs.py)
            log.debug("step_graphs.skipped", reason=f"no CUDA device ({engine.device}): "
                     "stepping eagerly")
            return None
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                pool = torch.cuda.graph_pool_handle()
                kinds = {kind: {shape: capture_one(engine, static_inputs(engine, kind, shape),
                                                   pool) for shape in classes.shapes}
                         for kind, classes in (("decode", engine.shapes),
                                               ("prefill", engine.prefills))}
                torch.cuda.synchronize(engine.device)
                for kind, graphs in kinds.items():
                    for shape in {min(graphs), max(graphs)} if graphs else ():
                        check(engine, kind, graphs[shape])
        except Exception as exc:  # graphs only save launch time: step eagerly, say why
            log.warning("step_graphs.failed", error=f"{type(exc).__name__}: {exc}",
                        hint="stepping eagerly; cuda_graphs = false skips the capture")
            return None
        log.info("step_graphs.captured", decode=len(kinds["decode"]),
                 prefill=len(kinds["prefill"]),
                 memory_mib=torch.cuda.memory_reserved(engine.device) >> 20,
                 seconds=round(time.perf_counter() - started, 2))
        return cls(kinds["decode"], kinds["prefill"])


def static_inputs(engine: Engine, kind: str, shape: Shape) -> tuple[torch.Tensor, GraphLayout]:
    """Buffers of the class's shape, all padding (the trash block)."""
    if kind == "decode":
        rows, queries = shape[0], 1
        layout: GraphLayout = DecodeLayout(engine.pool, [], [], shape)
    else:
        rows, queries = 1, shape[0]
        layout = PackedLayout(engine.pool, [], [], [], shape=shape, rows=engine.max_seqs)
    return torch.zeros(rows, queries, dtype=torch.long, device=engine.device), layout


def capture_one(engine: Engine, inputs: tuple[torch.Tensor, GraphLayout],
                pool: Any) -> StepGraph:
    """The engine's forward on the class's static buffers, captured after eager runs on a
    side stream (as torch.cuda.graph asks: lazy initialisation must not be captured)."""
    ids, layout = inputs
    device = engine.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            layout.reset()
            engine.logits(ids, layout)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layout.reset()  # the slots and masks are worked out inside the graph, not reused
    with torch.cuda.graph(graph, pool=pool):
        logits = engine.logits(ids, layout)
    return StepGraph(ids, layout, logits, graph)


def check_inputs(engine: Engine, kind: str,
                 shape: Shape) -> tuple[torch.Tensor, GraphLayout]:
    """Inputs unlike the captured ones: rows of 1..16 tokens on the trash block, the token
    at each position its position + 1, so rows that write the same slot write the same
    keys and values (same tokens, same prefix) and which write lands does not matter."""
    if kind == "decode":
        lengths = [1 + row % CHECK_SPREAD for row in range(shape[0])]
        ids = torch.tensor(lengths, device=engine.device)[:, None]
        return ids, DecodeLayout(engine.pool, [[0]] * len(lengths), lengths, shape)
    ends: list[int] = []
    while len(ends) < engine.max_seqs and sum(ends) + 1 + len(ends) % CHECK_SPREAD < shape[0]:
        ends.append(1 + len(ends) % CHECK_SPREAD)
    tokens = [position + 1 for end in ends for position in range(end)]
    tokens += [0] * (shape[0] - len(tokens))
    layout = PackedLayout(engine.pool, [list(range(end)) for end in ends], [0] * len(ends),
                          ends, shape=shape, rows=engine.max_seqs)
    return torch.tensor(tokens, device=engine.device)[None], layout


def check(engine: Engine, kind: str, graph: StepGraph) -> None:
    """Replay on check_inputs against the eager forward on the same."""
    shape = graph.layout.shape
    assert shape is not None
    ids, layout = check_inputs(engine, kind, shape)
    real = max(1, layout.real)  # a packed class too small for a row: its padding's logits
    replayed = graph.replay(ids, layout)[:real].float().clone()
    layout.reset()
    eager = engine.logits(ids, layout)[:real].float()
    difference = (replayed - eager).abs().max().item()
    if difference > TOLERANCE.get(engine.pool.keys[0].dtype, 0.1):
        raise RuntimeError(f"{kind} graph {shape} replays differ from eager by "
                           f"{difference:.3g}")
