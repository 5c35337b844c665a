"""Overlapped steps (worker/execution/generation.py `launch` / `finish`, staging.py): step n + 1
is launched before step n's tokens reach the host, as the generate loop does on a GPU. Its
decoding rows read their input tokens on the device, a sequence that ended in step n rides
along one more step whose token is dropped, and every sequence gets the tokens the steps
give one at a time, greedy and seeded-sampled, row by row and GPU-shaped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.execution.kv_pool import BLOCK_TOKENS
from worker.execution.step_results import Launched
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def started(tiny: tuple[Any, Any], gpu_shapes: bool, prompts: int = 9,
            device: torch.device = CPU) -> tuple[GenerationEngine, DecodingScheduler]:
    """Greedy and seeded-sampled requests, some ending at EOS, a stop string or their
    max_new_tokens, more than the engine runs at once (so some wait and are admitted
    while others decode)."""
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, device, [tokenizer.eos_token_id], max_seqs=4,
                              gpu_shapes=gpu_shapes)
    scheduler = DecodingScheduler(SchedulerLimits(max_seqs=4, max_step_tokens=24))
    for i in range(prompts):
        stop = ("e",) if i % 3 == 2 else ()
        params = SamplingParams(6 + 4 * i, 0.9, 0.9, 30, seed=i, stop=stop) if i % 2 else \
            SamplingParams(6 + 4 * i, stop=stop)
        ids = tokenizer(f"the stream {'of entries ' * i}{i}").input_ids
        engine.add(str(i), ids, params)
        scheduler.add(SeqState(str(i), len(ids), 6 + 4 * i))
    return engine, scheduler


def one_at_a_time(engine: GenerationEngine, scheduler: DecodingScheduler) -> dict[str, str]:
    texts: dict[str, str] = {}
    while len(scheduler):
        for seq in scheduler.update(engine.step(scheduler.schedule()).finished):
            done = engine.drop(seq.id)
            assert done is not None
            texts[seq.id] = done.text.text
    return texts


def overlapped(engine: GenerationEngine, scheduler: DecodingScheduler) -> dict[str, str]:
    """As the generate loop does with `overlap`: launch step n + 1, then finish step n."""
    texts: dict[str, str] = {}
    previous: Launched | None = None
    while len(scheduler) or previous is not None:
        launched = None
        if len(scheduler):
            plan = scheduler.schedule()
            scheduler.update()
            launched = engine.launch(plan)
            unrun = launched.unrun  # as the generate loop does when a step runs out
            if unrun is not None:
                assert scheduler.caps.on_out_of_memory(unrun.tokens, len(unrun.ran_out),
                                                       unrun.decoding)
                scheduler.recompute(unrun.works)
        if previous is not None:
            for delta in engine.finish(previous).deltas:
                if delta.finish_reason:
                    scheduler.remove(delta.id)
                    done = engine.drop(delta.id)
                    assert done is not None
                    texts[delta.id] = done.text.text
        previous = launched
    return texts


@pytest.mark.parametrize("gpu_shapes", [False, True], ids=["row-by-row", "gpu-shaped"])
def test_overlapped_steps_give_every_sequence_the_tokens_of_steps_one_at_a_time(
        tiny: tuple[Any, Any], gpu_shapes: bool) -> None:
    expected = one_at_a_time(*started(tiny, gpu_shapes))
    engine, scheduler = started(tiny, gpu_shapes)
    late: list[int] = []
    sent_back: list[bool] = []
    launch = engine.launch

    def counting(plan: Any, on_prefilled: Any = None) -> Launched:
        launched = launch(plan, on_prefilled)
        late.append(sum(len(f.late[0]) for f in launched.forwards))
        sent_back.append(launched.tokens is not None)
        return launched

    engine.launch = counting  # type: ignore[method-assign]
    assert overlapped(engine, scheduler) == expected and len(expected) == 9
    assert sum(late) > 20  # decoding rows read their token on the device
    assert engine.buffers.copies_back == sum(sent_back)  # one copy back per step at most
    assert not engine.seqs and engine.flight is None
    assert engine.pool.free_tokens == (engine.pool.blocks - 1) * BLOCK_TOKENS  # all given back


@pytest.mark.parametrize("gpu_shapes", [False, True], ids=["row-by-row", "gpu-shaped"])
def test_forwards_that_run_out_of_memory_are_recomputed_to_the_same_tokens(
        tiny: tuple[Any, Any], gpu_shapes: bool) -> None:
    """Every third forward that could be smaller (more than one row, or a prefill of more
    than 16 tokens) raises CUDA's OutOfMemoryError, prefills and decodes, some with a step in
    flight: what did not run is recomputed, and every sequence, greedy and seeded, still gets
    the tokens of steps run one at a time."""
    expected = one_at_a_time(*started(tiny, gpu_shapes))
    recomputed_after_running_out(*started(tiny, gpu_shapes), expected)


def recomputed_after_running_out(engine: GenerationEngine, scheduler: DecodingScheduler,
                                 expected: dict[str, str]) -> None:
    run, calls, unrun = engine._run, [0], []

    def short_of_memory(forward: Any) -> torch.Tensor | None:
        tokens = sum(work.tokens for work in forward.works)
        if len(forward.works) > 1 or (not forward.batched and tokens > 16):
            calls[0] += 1
            if calls[0] % 3 == 0:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return run(forward)

    launch = engine.launch

    def counting(plan: Any, on_prefilled: Any = None) -> Launched:
        launched = launch(plan, on_prefilled)
        unrun.append(launched.unrun)
        return launched

    engine._run = short_of_memory  # type: ignore[method-assign]
    engine.launch = counting  # type: ignore[method-assign]
    assert overlapped(engine, scheduler) == expected and len(expected) == 9
    failed = [u for u in unrun if u is not None]
    assert len(failed) >= 3 and any(u.decoding for u in failed)
    assert any(not u.decoding for u in failed)
    assert not engine.seqs and engine.pool.free_tokens == (engine.pool.blocks - 1) * BLOCK_TOKENS


def test_a_sequence_ended_in_flight_is_not_given_the_late_step_s_token(
        tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, CPU, [tokenizer.eos_token_id])
    scheduler = DecodingScheduler(SchedulerLimits())
    ids = tokenizer("hello redis").input_ids
    engine.add("a", ids, SamplingParams(2))
    scheduler.add(SeqState("a", len(ids), 50))  # the scheduler does not know it ends at 2
    first = engine.launch(scheduler.schedule())
    scheduler.update()
    second = engine.launch(scheduler.schedule())  # its decode row reads the first's token
    scheduler.update()
    third = engine.launch(scheduler.schedule())  # a step too late: it has ended by then
    assert [d.finish_reason for d in engine.finish(first).deltas] == [None]
    assert [d.finish_reason for d in engine.finish(second).deltas] == ["length"]
    assert engine.finish(third).deltas == [] and len(engine.seqs["a"].text.generated) == 2
    assert engine.flight is None
    assert engine.pool.free_tokens == (engine.pool.blocks - 1) * BLOCK_TOKENS


@pytest.fixture
def on_cuda(tiny: tuple[Any, Any]) -> Iterator[tuple[dict[str, str], GenerationEngine,
                                                    DecodingScheduler]]:
    """The tiny model on CUDA: the tokens of steps in turn, and a GPU-shaped engine with its
    graphs captured and its scheduler, on the same requests (the model back on the CPU
    after)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lm, tokenizer = tiny
    cuda = (lm.to("cuda"), tokenizer)
    try:
        expected = one_at_a_time(*started(cuda, True, device=torch.device("cuda")))
        engine, scheduler = started(cuda, True, device=torch.device("cuda"))
        assert engine.capture_graphs() is not None
        yield expected, engine, scheduler
    finally:
        lm.to("cpu")


def test_on_cuda_overlapped_steps_and_their_graphs_give_the_tokens_of_steps_in_turn(
        on_cuda: tuple[dict[str, str], GenerationEngine, DecodingScheduler]) -> None:
    expected, engine, scheduler = on_cuda
    assert overlapped(engine, scheduler) == expected  # the copies back are asynchronous
    assert engine.graphs is not None
    assert engine.graphs.replays["decode"] > 0 and engine.graphs.replays["prefill"] > 0


def test_on_cuda_steps_out_of_memory_are_recomputed_under_graphs_to_the_same_tokens(
        on_cuda: tuple[dict[str, str], GenerationEngine, DecodingScheduler]) -> None:
    """As on the CPU, overlapped, with graphs captured and the CUDA cache emptied."""
    recomputed_after_running_out(*on_cuda[1:], on_cuda[0])
