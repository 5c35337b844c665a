"""CUDA graphs for the encoder (execution/cuda_graphs.py). The replay wrapper's logic (the
shape a batch runs in, padded rows and tokens, the output cut to the real rows, eager for
other shapes) is checked here with a plain eager stand-in for a graph; the capture itself
only on a CUDA device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from structlog.testing import capture_logs

from tests.rigs.workers import loaded_model
from worker.app import build_worker
from worker.execution import cuda_graphs
from worker.execution.cuda_graphs import GraphedForward, StaticShape, fill, static_batch
from worker.execution.executor import Executor
from worker.models.base import Model, Prepared
from worker.policy.shape_classes import shape_classes
from worker.settings import load_settings

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def row_sums(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """An encoder stand-in whose output depends on every real token and on nothing else."""
    return (batch["ids"] * batch["mask"]).sum(dim=1, keepdim=True).float()


def stand_in_capture(rows: int, length: int, runs: list[tuple[int, int]]) -> StaticShape:
    """A 'graph' that replays row_sums on its static buffers and records the shape it ran."""
    inputs = {"ids": torch.full((rows, length), 7), "mask": torch.ones(rows, length,
                                                                      dtype=torch.long)}
    output = torch.zeros(rows, 1)

    def replay() -> None:
        runs.append(tuple(inputs["ids"].shape))
        output.copy_(row_sums(inputs))

    return StaticShape(inputs, output, replay)


def graphed(runs: list[tuple[int, int]]) -> tuple[GraphedForward, list[int]]:
    classes = shape_classes([8, 16], max_batch_size=8, max_batch_tokens=1024)
    eager: list[int] = []

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        eager.append(batch["ids"].shape[0])
        return row_sums(batch)

    shapes = {shape: stand_in_capture(*shape, runs) for shape in classes.shapes}
    return GraphedForward(forward, classes, shapes, torch.device("cpu")), eager


def batch_of(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Zero-padded ids 1..n and their mask, as a collate makes them."""
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.arange(1, n + 1)
    return {"ids": ids, "mask": (ids > 0).long()}


def test_a_batch_replays_in_the_smallest_shape_and_gets_its_own_rows_back() -> None:
    runs: list[tuple[int, int]] = []
    forward, eager = graphed(runs)
    batch = batch_of([5, 3, 1])
    output = forward(batch)
    assert runs == [(4, 8)]  # 3 rows padded to 4, 5 tokens to the bucket's 8
    assert torch.equal(output, row_sums(batch)) and output.shape == (3, 1)
    assert eager == [] and forward.replays == 1


def test_a_shorter_batch_after_a_longer_one_sees_none_of_its_tokens() -> None:
    runs: list[tuple[int, int]] = []
    forward, _ = graphed(runs)
    forward(batch_of([8, 8, 8]))
    output = forward(batch_of([2, 1]))  # the buffers' tokens past 2 must be zeroed
    assert runs == [(4, 8), (2, 8)]
    assert output.flatten().tolist() == [3.0, 1.0]


def test_the_output_is_a_copy_the_next_replay_does_not_change() -> None:
    forward, _ = graphed([])
    first = forward(batch_of([4]))
    forward(batch_of([6]))
    assert first.flatten().tolist() == [10.0]


def test_shapes_no_class_holds_run_eagerly() -> None:
    runs: list[tuple[int, int]] = []
    forward, eager = graphed(runs)
    too_long, too_many = batch_of([17]), batch_of([2] * 9)
    assert torch.equal(forward(too_long), row_sums(too_long))
    assert torch.equal(forward(too_many), row_sums(too_many))
    assert runs == [] and len(eager) == 2 and forward.eager == 2
    assert forward.static_for(torch.ones(2, 3)) is None  # not a mapping of tensors
    assert forward.static_for({"ids": torch.ones(2), "mask": torch.ones(2)}) is None  # 1-D


def test_other_input_names_run_eagerly() -> None:
    forward, _ = graphed([])
    assert forward.static_for({"ids": torch.ones(1, 4, dtype=torch.long)}) is None
    assert forward.static_for(batch_of([3])) is not None


def test_fill_zero_pads_the_rows_it_writes_and_leaves_the_rest() -> None:
    buffers = {"ids": torch.full((4, 6), 9)}
    assert fill(buffers, {"ids": torch.ones(2, 3, dtype=torch.long)}) == 2
    assert buffers["ids"].tolist() == [[1, 1, 1, 0, 0, 0]] * 2 + [[9] * 6] * 2


def test_minilm_padded_to_a_captured_shape_gives_each_row_its_eager_embedding() -> None:
    """What a replay computes, on a CPU: the real model on the batch padded to its class
    (rows and tokens) gives the real rows eager's embeddings; check_replay agrees."""
    model = loaded_model("minilm")
    classes = shape_classes([8, 16], max_batch_size=4, max_batch_tokens=1024)
    shapes = {}
    for rows, length in classes.shapes:
        inputs = static_batch(model, torch.device("cpu"), rows, length)
        assert inputs is not None
        output = torch.zeros(rows, 384)
        shapes[rows, length] = StaticShape(
            inputs, output, lambda i=inputs, o=output: o.copy_(model.forward(i)))
    graphed = GraphedForward(model.forward, classes, shapes, torch.device("cpu"))
    texts = ["a short one", "a sentence of a few more words", "hello"]  # 5, 9 and 3 tokens
    batch = model.collate([model.prepare({"text": text}, len(text)) for text in texts])
    assert graphed.static_for(batch) is shapes[4, 16]  # a row and 7 tokens of padding
    with torch.inference_mode():
        replayed, eager = graphed(batch), model.forward(batch)
        cuda_graphs.check_replay(graphed, model, torch.device("cpu"))
    assert graphed.replays == 2
    assert torch.allclose(replayed, eager, atol=1e-5)


class Plain(Model):
    """A model that does not declare graph_capturable."""

    def load(self, device: torch.device) -> None: ...
    def prepare(self, payload: Any, nbytes: int) -> Prepared: return Prepared(1, payload)
    def collate(self, items: Any) -> Any: return items
    def forward(self, batch: Any) -> Any: return batch
    def postprocess(self, output: Any, items: Any) -> list[Any]: return list(output)


def test_on_a_cpu_nothing_is_captured_and_the_executor_runs_eagerly() -> None:
    model = Plain()
    model.graph_capturable = True
    executor = Executor(model, torch.device("cpu"))
    assert cuda_graphs.install([executor], model, torch.device("cpu"), [8], 4, 64) is None
    assert executor.graphs is None and executor.another().graphs is None


@needs_cuda
def test_a_model_that_is_not_capturable_is_left_eager() -> None:
    model, device = Plain(), torch.device("cuda")
    executor = Executor(model, device)
    assert cuda_graphs.install([executor], model, device, [8], 4, 64) is None
    assert executor.graphs is None


@needs_cuda
def test_minilm_replays_match_eager_on_cuda() -> None:
    from worker.models.minilm import MiniLMModel

    device = torch.device("cuda")
    model = MiniLMModel()
    model.load(device)
    executors = [Executor(model, device)]
    executors.append(executors[0].another())
    forward = cuda_graphs.install(executors, model, device, [16, 32], 8, 1024)
    assert forward is not None and all(e.graphs is forward for e in executors)
    texts = ["a short one", "a sentence of a few more words than that, to pad the others"]
    items = [model.prepare({"text": text}, len(text)) for text in texts]
    replays = forward.replays  # the capture's own check replayed once already
    graphed, eager = executors[1].run(items), Executor(model, device).run(items)
    assert forward.replays == replays + 1 and forward.eager == 0
    for mine, theirs in zip(graphed, eager, strict=True):
        assert torch.nn.functional.cosine_similarity(
            torch.as_tensor(mine["embedding"]), torch.as_tensor(theirs["embedding"]),
            dim=0) > 0.999


def test_an_executor_replays_its_graphs_in_place_of_the_forward_and_shares_them() -> None:
    model = Plain()
    executor = Executor(model, torch.device("cpu"))
    executor.graphs = lambda batch: [f"replayed {item.data}" for item in batch]
    items = [Prepared(1, "a"), Prepared(1, "b")]
    assert executor.another().run(items) == ["replayed a", "replayed b"]
    executor.graphs = None
    assert executor.run(items) == items


@pytest.mark.parametrize("flags, level", [({"cuda_graphs": True}, "info"), ({}, "debug")])
def test_on_a_cpu_the_worker_says_once_that_it_skips_the_capture(
        flags: dict[str, bool], level: str, redis_url: str, r: redis.Redis,
        tmp_path: Path) -> None:
    """One line: at info when the user asked for graphs, at debug for the default."""
    settings = load_settings(None, redis_url=redis_url, model="echo", device="cpu",
                             metrics_port=0, calibration_dir=tmp_path, warmup=False, **flags)
    with capture_logs() as logs:
        worker = build_worker(settings, r)
    skipped = [entry for entry in logs if entry["event"] == "cuda_graphs.skipped"]
    assert [entry["log_level"] for entry in skipped] == [level]
    assert "no CUDA device" in skipped[0]["reason"]
    assert all(runner.executor.graphs is None for runner in worker.runners)
