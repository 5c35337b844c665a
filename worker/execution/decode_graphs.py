"""CUDA graphs of the engine's decode step, one per shape class, captured at start.

A decode step of a small model on a large GPU is a thousand short kernels, each launched
from Python: the launches bound it, not the arithmetic (on an H200, SmolLM2-135M decoded
at 159 tokens/s at batch 64 eagerly). A CUDA graph launches them all at once. The engine
pads a decode step to a shape class (policy/shape_classes.py `decode_classes`: rows 1, 2,
4, ... up to max_seqs; context 256, 512, ... tokens) in kv_pool.DecodeLayout, whose every
tensor has a fixed shape per class and whose slots and mask are worked out on the device
inside the forward. So the forward is captured once per class from static buffers, all
graphs drawing on one memory pool; a step copies its inputs into its class's buffers and
replays (prefills, and contexts past the longest class, run eagerly). The KV pool's tensors
never move, so the graphs write and read them in place.

Each capture is checked against the eager forward on other inputs than it was captured
with; any failure leaves the engine eager, with one log line saying why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from worker.execution.kv_pool import KVPool
from worker.execution.step_layouts import DecodeLayout
from worker.policy.shape_classes import ShapeClasses

log = structlog.get_logger("redbatch.decode_graphs")
Shape = tuple[int, int]  # (rows, context length class)
WARMUP_RUNS = 2  # eager runs on a side stream before a capture: lazy initialisation settles
CHECK_SPREAD = 16  # the check's rows read 1..16 tokens of the trash block
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.1}  # logits


class Engine(Protocol):
    """What a capture needs of the engine (execution/generation.py)."""

    device: torch.device
    pool: KVPool

    def logits(self, ids: torch.Tensor, layout: Any) -> torch.Tensor: ...


@dataclass(slots=True)
class DecodeGraph:
    """One class's graph: the static buffers it reads and the logits it writes."""

    ids: torch.Tensor  # [rows, 1]
    layout: DecodeLayout  # bound to static write, tables, lengths and positions
    logits: torch.Tensor  # [rows, vocab]
    graph: Any  # torch.cuda.CUDAGraph

    def replay(self, ids: torch.Tensor, layout: DecodeLayout) -> torch.Tensor:
        """Copy the step's inputs in, replay; the logits stay valid until the next replay."""
        self.ids.copy_(ids, non_blocking=True)
        static = self.layout
        for mine, theirs in ((static.write, layout.write), (static.tables, layout.tables),
                             (static.lengths, layout.lengths),
                             (static.positions, layout.positions)):
            mine.copy_(theirs, non_blocking=True)
        self.graph.replay()
        return self.logits


class DecodeGraphs:
    def __init__(self, graphs: dict[Shape, DecodeGraph]) -> None:
        self.graphs = graphs
        self.replays = 0

    def get(self, shape: Shape) -> DecodeGraph | None:
        graph = self.graphs.get(shape)
        self.replays += graph is not None
        return graph

    @classmethod
    def capture(cls, engine: Engine, shapes: ShapeClasses) -> DecodeGraphs | None:
        """Every class of `shapes`, the largest first, in one memory pool; None (and one log
        line) without CUDA or when a capture fails or disagrees with the eager forward."""
        if engine.device.type != "cuda":  # the worker said so at start (cuda_graphs.py)
            log.debug("decode_graphs.skipped", reason=f"no CUDA device ({engine.device}): "
                     "decoding eagerly")
            return None
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                pool = torch.cuda.graph_pool_handle()
                graphs = {shape: capture_one(engine, shape, pool) for shape in shapes.shapes}
                torch.cuda.synchronize(engine.device)
                for shape in (min(graphs), max(graphs)):
                    check(engine, graphs[shape])
        except Exception as exc:  # graphs only save launch time: decode eagerly, say why
            log.warning("decode_graphs.failed", error=f"{type(exc).__name__}: {exc}",
                        hint="decoding eagerly; cuda_graphs = false skips the capture")
            return None
        log.info("decode_graphs.captured", shapes=len(graphs),
                 rows=sorted({rows for rows, _ in graphs}),
                 lengths=sorted({length for _, length in graphs}),
                 memory_mib=torch.cuda.memory_reserved(engine.device) >> 20,
                 seconds=round(time.perf_counter() - started, 2))
        return cls(graphs)


def static_inputs(engine: Engine, shape: Shape) -> tuple[torch.Tensor, DecodeLayout]:
    """Buffers of the class's shape: every row padding (the trash block, one key)."""
    layout = DecodeLayout(engine.pool, [], [], shape)
    return torch.zeros(shape[0], 1, dtype=torch.long, device=engine.device), layout


def capture_one(engine: Engine, shape: Shape, pool: Any) -> DecodeGraph:
    """The engine's forward on the class's static buffers, captured after eager runs on a
    side stream (as torch.cuda.graph asks: lazy initialisation must not be captured)."""
    ids, layout = static_inputs(engine, shape)
    device = engine.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            layout.reset()
            engine.logits(ids, layout)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layout.reset()  # the slots and mask are worked out inside the graph, not reused
    with torch.cuda.graph(graph, pool=pool):
        logits = engine.logits(ids, layout)
    return DecodeGraph(ids, layout, logits, graph)


def check(engine: Engine, graph: DecodeGraph) -> None:
    """Replay on inputs unlike the captured ones (rows of different lengths and tokens, on
    the trash block), against the eager forward on the same. Rows that write the same
    slot carry the same token at the same position, so which write lands does not matter."""
    rows = graph.layout.rows
    lengths = [1 + row % CHECK_SPREAD for row in range(rows)]
    layout = DecodeLayout(engine.pool, [[0]] * rows, lengths, graph.layout.shape)
    ids = torch.tensor(lengths, device=engine.device)[:, None]
    replayed = graph.replay(ids, layout).float().clone()
    layout.reset()
    eager = engine.logits(ids, layout).float()
    difference = (replayed - eager).abs().max().item()
    if difference > TOLERANCE.get(engine.pool.keys[0].dtype, 0.1):
        raise RuntimeError(f"decode graph {graph.layout.shape} replays differ from eager "
                           f"by {difference:.3g}")

