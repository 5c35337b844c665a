"""A decoding step shaped for a device (worker/execution/generation.py, step_buffers.py): its
inputs go in one host-to-device copy through preallocated buffers, its tokens come back in
one copy, and nothing else reads a value back to the host, sampled rows included."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.execution.step_buffers import StepBuffers
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def running(tiny: tuple[Any, Any], rows: int) -> tuple[GenerationEngine, DecodingScheduler]:
    """An engine with `rows` sequences (every other one sampled) past their prefill."""
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    scheduler = DecodingScheduler(SchedulerLimits())
    for i in range(rows):
        params = SamplingParams(60, 0.8, 0.9, 20, seed=i) if i % 2 else SamplingParams(60)
        ids = tokenizer(f"hello redis {i}").input_ids
        engine.add(str(i), ids, params)
        scheduler.add(SeqState(str(i), len(ids), 60))
    for _ in range(3):
        scheduler.update(engine.step(scheduler.schedule()).finished)
    return engine, scheduler


def test_a_decode_step_makes_one_copy_in_and_reads_nothing_back_but_its_tokens(
        tiny: tuple[Any, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine, scheduler = running(tiny, 8)
    plan = scheduler.schedule()
    assert len(plan.decode) == 8 and not plan.prefill
    before = engine.buffers.copies
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        output = engine.step(plan)
    names = collections.Counter(e.name for e in prof.events())
    assert engine.buffers.copies - before == 1
    assert names["aten::_local_scalar_dense"] == 0  # no int(tensor), no .item(): no sync
    assert names["aten::lift_fresh"] <= 6  # host tensors: the parts written into the buffer
    assert len(output.deltas) == 8


def test_a_step_with_prefills_still_copies_its_inputs_once(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    scheduler = DecodingScheduler(SchedulerLimits(prefill_first=False))
    for i in range(3):
        engine.add(str(i), tokenizer(f"the quick brown {i}").input_ids, SamplingParams(8))
        scheduler.add(SeqState(str(i), len(tokenizer(f"the quick brown {i}").input_ids), 8))
    plan = scheduler.schedule()
    assert len(plan.prefill) == 3
    engine.step(plan)
    assert engine.buffers.copies == 1


def test_the_buffers_grow_and_hand_back_views_of_what_was_written() -> None:
    buffers = StepBuffers(torch.device("cpu"), capacity=4)
    floats = torch.tensor([0.5, 1e-300], dtype=torch.float64).view(torch.int64)
    ids, bits = buffers.upload([[1, 2, 3], floats])
    assert ids.tolist() == [1, 2, 3]
    assert bits.view(torch.float64).tolist() == [0.5, 1e-300]
    assert buffers.host.numel() == 8 and buffers.copies == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_buffer_is_pinned_and_the_views_on_the_device() -> None:
    buffers = StepBuffers(torch.device("cuda"))
    (view,) = buffers.upload([[4, 5]])
    assert buffers.host.is_pinned() and view.is_cuda and view.tolist() == [4, 5]


def test_on_a_cpu_the_tokens_come_back_as_they_are() -> None:
    buffers = StepBuffers(torch.device("cpu"))
    tokens = torch.tensor([7, 8, 9])
    host, copied = buffers.download(tokens)
    assert host is tokens and copied is None and buffers.copies_back == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_tokens_come_back_into_pinned_buffers_that_take_turns() -> None:
    buffers = StepBuffers(torch.device("cuda"))
    first, first_copied = buffers.download(torch.arange(3, device="cuda"))
    second, second_copied = buffers.download(torch.arange(5, 10, device="cuda"))
    first_copied.synchronize()
    second_copied.synchronize()
    assert first.is_pinned() and second.is_pinned()
    assert first.tolist() == [0, 1, 2] and second.tolist() == [5, 6, 7, 8, 9]  # not shared
