"""The steps a GPU runs (worker/execution/step_layouts.py, paged_attention.py, step_graphs.py):
decoding rows padded to a shape class and prefill chunks packed into one row padded to a
(queries, keys) class, each with one gather and one attention call per layer. On this CPU:
they attend like plain SDPA over each row's own keys, give the engine the same tokens as the
row-by-row steps, and launch one attention per layer; the CUDA graph capture is skipped
cleanly here (replays are checked with a stand-in that reruns the forward on the graphs'
static buffers) and checked against eager on a GPU."""

from __future__ import annotations

import collections
import os
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.models.test_paged_attention import cached_rows, dense_reference
from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.execution.kv_pool import TRASH_SLOT, KVPool
from worker.execution.paged_attention import paged_attention, stepping
from worker.execution.step_graphs import StepGraph, StepGraphs, check, static_inputs
from worker.execution.step_layouts import DecodeLayout, PackedLayout
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")
LAYERS, KV_HEADS, DIM = 2, 2, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_the_layout_pads_rows_and_reads_the_trash_block_past_each_length() -> None:
    pool = KVPool(LAYERS, KV_HEADS, DIM, tokens=64, dtype=torch.float32, device=CPU)
    layout = DecodeLayout(pool, [[3], [1, 2]], [5, 17], shape=(4, 20))
    assert (layout.rows, layout.length, layout.real) == (4, 32, 2)  # 20 rounded to blocks
    assert layout.write.tolist() == [3 * 16 + 4, 2 * 16 + 0, TRASH_SLOT, TRASH_SLOT]
    assert layout.positions.view(-1).tolist() == [4, 16, 0, 0]
    read = layout.read.view(4, 32)
    assert read[0, :5].tolist() == [48, 49, 50, 51, 52] and not read[0, 5:].any()
    assert read[1, :17].tolist() == [*range(16, 32), 32] and not read[1, 17:].any()
    assert not read[2:].any()
    visible = layout.visible(None).view(4, 32).sum(dim=1).tolist()
    assert visible == [5, 17, 1, 1] and layout.visible(4).view(4, 32).sum(dim=1).tolist() == [
        4, 4, 1, 1]


def check_random_decode(rng: random.Random, heads: int, window: int | None) -> None:
    real = rng.randint(1, 6)
    ends = [rng.randint(1, 60) for _ in range(real)]
    # unwritten slots may hold NaN: they must never be read
    pool, tables, layer, full_k, full_v = cached_rows(rng, [e - 1 for e in ends], ends, 128,
                                                      unwritten=float("nan"))
    rows = real + rng.randint(0, 3)
    layout = DecodeLayout(pool, tables, ends, shape=(rows, max(ends) + rng.randint(0, 40)))
    q = torch.randn(rows, heads, 1, DIM)
    new_k = torch.zeros(rows, KV_HEADS, 1, DIM)
    new_v = torch.zeros(rows, KV_HEADS, 1, DIM)
    for row in range(real):
        new_k[row, :, 0], new_v[row, :, 0] = full_k[row][:, -1], full_v[row][:, -1]
    with stepping(layout):
        out, _ = paged_attention(SimpleNamespace(layer_idx=layer), q, new_k, new_v, None,
                                 sliding_window=window)
    assert out.shape == (rows, 1, heads, DIM) and layout.attended == 1
    for row, end in enumerate(ends):
        expected = dense_reference(q[row], full_k[row], full_v[row], end - 1, window)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any()


@pytest.mark.parametrize(("heads", "window"), [(2, None), (6, None), (4, 7)])
def test_decode_attention_equals_plain_sdpa_on_random_padded_layouts(
        heads: int, window: int | None) -> None:
    rng = random.Random(heads * 10 + (window or 0))
    torch.manual_seed(heads)
    for _ in range(40):
        check_random_decode(rng, heads, window)


def check_random_packed(rng: random.Random, heads: int, window: int | None,
                        padded: bool) -> None:
    rows = rng.randint(1, 5)
    starts = [rng.choice([0, rng.randint(0, 40)]) for _ in range(rows)]
    ends = [s + rng.randint(1, 20) for s in starts]
    # unwritten slots may hold NaN: padding must read only what padding wrote
    pool, tables, layer, full_k, full_v = cached_rows(
        rng, starts, ends, unwritten=float("nan") if padded else None)
    queries = sum(e - s for s, e in zip(starts, ends, strict=True))
    shape = (queries + rng.randint(0, 9), sum(ends) + rng.randint(1, 9)) if padded else None
    layout = PackedLayout(pool, [pool.slots(t, e).tolist() for t, e in zip(tables, ends,
                                                                             strict=True)],
                          starts, ends, shape=shape, rows=rows + rng.randint(0, 3))
    q = torch.randn(1, heads, layout.queries, DIM)
    pad = torch.zeros(KV_HEADS, layout.queries - queries, DIM)
    new_k = torch.cat([k[:, s:] for k, s in zip(full_k, starts, strict=True)] + [pad],
                      dim=1)[None]
    new_v = torch.cat([v[:, s:] for v, s in zip(full_v, starts, strict=True)] + [pad],
                      dim=1)[None]
    with stepping(layout):
        out, _ = paged_attention(SimpleNamespace(layer_idx=layer), q, new_k, new_v, None,
                                 sliding_window=window)
    assert out.shape == (1, layout.queries, heads, DIM)
    at = 0
    for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
        n = end - start
        expected = dense_reference(q[0, :, at:at + n], full_k[row], full_v[row], start, window)
        torch.testing.assert_close(out[0, at:at + n], expected, atol=1e-5, rtol=1e-5)
        at += n
    assert layout.keep.tolist()[:rows] == [
        sum(e - s for s, e in zip(starts[:r + 1], ends[:r + 1], strict=True)) - 1
        for r in range(rows)]
    assert not out.isnan().any()  # padding queries attend to the padding key they wrote


@pytest.mark.parametrize(("heads", "window", "padded"),
                         [(2, None, False), (6, None, False), (4, 7, False),
                          (2, None, True), (6, None, True), (4, 7, True)])
def test_packed_prefill_attention_equals_plain_sdpa_on_random_layouts(
        heads: int, window: int | None, padded: bool) -> None:
    rng = random.Random(heads * 7 + (window or 0) + padded)
    torch.manual_seed(heads + 1)
    for _ in range(40):
        check_random_packed(rng, heads, window, padded)


def test_a_packed_prefill_pads_its_queries_keys_and_rows_to_the_class() -> None:
    pool = KVPool(LAYERS, KV_HEADS, DIM, tokens=64, dtype=torch.float32, device=CPU)
    layout = PackedLayout(pool, [[48, 49, 50], [16, 17]], [1, 0], [3, 2], shape=(6, 8),
                          rows=3)
    assert (layout.queries, layout.length, layout.real, layout.shape) == (6, 8, 2, (6, 8))
    assert layout.write.tolist() == [49, 50, 16, 17, TRASH_SLOT, TRASH_SLOT]
    assert layout.read.tolist() == [48, 49, 50, 16, 17, TRASH_SLOT, TRASH_SLOT, TRASH_SLOT]
    assert layout.positions.view(-1).tolist() == [1, 2, 0, 1, 0, 0]
    assert layout.keep.tolist() == [1, 3, 0]  # a padding row keeps the first token's logits
    seen = layout.visible(None)[0, 0].int().tolist()
    assert seen == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0],
                    [0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0, 0],
                    [0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]


def engine_of(tiny: tuple[Any, Any], padded: bool,
              device: torch.device = CPU) -> GenerationEngine:
    lm, tokenizer = tiny
    return GenerationEngine(lm, tokenizer, device, [tokenizer.eos_token_id], max_seqs=8,
                            gpu_shapes=padded)


def generate(tiny: tuple[Any, Any], padded: bool, prompts: int = 7,
             engine: GenerationEngine | None = None) -> dict[str, list[int]]:
    """Greedy and seeded-sampled sequences to the end, through the scheduler."""
    tokenizer = tiny[1]
    engine = engine or engine_of(tiny, padded)
    scheduler = DecodingScheduler(SchedulerLimits(max_seqs=8))
    for i in range(prompts):
        params = SamplingParams(12 + 5 * i, 0.8, 0.9, 20, seed=i) if i % 2 else \
            SamplingParams(12 + 5 * i)
        ids = tokenizer(f"hello redis {'stream ' * i}{i}").input_ids
        engine.add(str(i), ids, params)
        scheduler.add(SeqState(str(i), len(ids), 12 + 5 * i))
    outputs: dict[str, list[int]] = {}
    while len(scheduler):
        for seq in scheduler.update(engine.step(scheduler.schedule()).finished):
            done = engine.drop(seq.id)
            assert done is not None
            outputs[seq.id] = list(done.text.generated)
    return outputs


def test_gpu_shaped_steps_give_the_row_by_row_steps_tokens(tiny: tuple[Any, Any]) -> None:
    rowwise, padded = generate(tiny, padded=False), generate(tiny, padded=True)
    assert len(padded) == 7 and padded == rowwise


def test_a_padded_decode_step_runs_one_attention_per_layer(tiny: tuple[Any, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    lm, tokenizer = tiny
    counts = {}
    for padded in (False, True):
        engine = GenerationEngine(lm, tokenizer, CPU, [], gpu_shapes=padded)  # no EOS: 6 rows
        scheduler = DecodingScheduler(SchedulerLimits())
        for i in range(6):
            engine.add(str(i), tokenizer(f"a b c {i}").input_ids, SamplingParams(40))
            scheduler.add(SeqState(str(i), len(tokenizer(f"a b c {i}").input_ids), 40))
        for _ in range(2):
            scheduler.update(engine.step(scheduler.schedule()).finished)
        plan = scheduler.schedule()
        assert len(plan.decode) == 6 and not plan.prefill
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(plan)
        names = collections.Counter(e.name for e in prof.events())
        counts[padded] = names["aten::scaled_dot_product_attention"]
        assert names["aten::_local_scalar_dense"] == 0  # no sync but the tokens' copy
    assert counts == {False: 6 * lm.config.n_layer, True: lm.config.n_layer}


def test_a_step_s_prefills_run_as_one_packed_forward(tiny: tuple[Any, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, CPU, [tokenizer.eos_token_id], gpu_shapes=True)
    scheduler = DecodingScheduler(SchedulerLimits())
    for i in range(3):
        ids = tokenizer(f"the quick brown {'fox ' * i}").input_ids
        engine.add(str(i), ids, SamplingParams(8))
        scheduler.add(SeqState(str(i), len(ids), 8))
    plan = scheduler.schedule()
    assert len(plan.prefill) == 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        output = engine.step(plan)
    names = collections.Counter(e.name for e in prof.events())
    assert names["aten::scaled_dot_product_attention"] == lm.config.n_layer
    assert engine.buffers.copies == 1 and len(output.deltas) == 3


def test_on_a_cpu_the_step_graphs_are_skipped_and_steps_stay_eager(
        tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, CPU, [tokenizer.eos_token_id])
    assert engine.capture_graphs() is None and engine.graphs is None
    assert not engine.gpu_shapes  # a CPU attends row by row unless asked


class Rerun:
    """Stands in for a CUDA graph on a CPU: a replay re-runs the captured forward on the
    static buffers, as the graph re-runs its kernels on them, and writes the same output."""

    def __init__(self, engine: GenerationEngine, graph: StepGraph) -> None:
        self.engine, self.graph = engine, graph

    def replay(self) -> None:
        self.graph.layout.reset()
        self.graph.logits.copy_(self.engine.logits(self.graph.ids, self.graph.layout))


def rerun_graphs(engine: GenerationEngine) -> StepGraphs:
    kinds: dict[str, dict[tuple[int, int], StepGraph]] = {"decode": {}, "prefill": {}}
    for kind, classes in (("decode", engine.shapes), ("prefill", engine.prefills)):
        for shape in classes.shapes:
            ids, layout = static_inputs(engine, kind, shape)
            graph = StepGraph(ids, layout, engine.logits(ids, layout).clone(), None)
            graph.graph = Rerun(engine, graph)
            kinds[kind][shape] = graph
    return StepGraphs(kinds["decode"], kinds["prefill"])


def test_replays_copy_each_step_into_their_class_s_buffers_and_give_eager_s_tokens(
        tiny: tuple[Any, Any]) -> None:
    eager = generate(tiny, padded=True)
    assert eager == generate(tiny, padded=False)
    engine = engine_of(tiny, padded=True)
    engine.graphs = rerun_graphs(engine)
    assert generate(tiny, padded=True, engine=engine) == eager
    assert engine.graphs.replays["decode"] > 10 and engine.graphs.replays["prefill"] >= 1
    for kind in ("decode", "prefill"):
        graphs = getattr(engine.graphs, kind)
        for shape in (min(graphs), max(graphs)):
            check(engine, kind, graphs[shape])  # the start-up check passes on them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_step_graphs_replay_the_eager_tokens(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    cuda = (lm.to("cuda"), tokenizer)
    cuda_device = torch.device("cuda")
    eager = generate(cuda, padded=True, engine=engine_of(cuda, True, cuda_device))
    engine = engine_of(cuda, True, cuda_device)
    graphs = engine.capture_graphs()
    assert graphs is not None and (8, 256) in graphs.decode and (64, 64) in graphs.prefill
    replayed = generate(cuda, padded=True, engine=engine)
    lm.to("cpu")
    assert graphs.replays["decode"] > 0 and graphs.replays["prefill"] > 0
    assert replayed == eager
