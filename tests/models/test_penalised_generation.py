"""Penalties, logit_bias and min_tokens through the engine (worker/execution/penalties.py):
a +100 bias makes the model emit the token, min_tokens holds EOS off, a penalised request
gets the same tokens alone, in a crowded batch with preemptions, after a resume and with
overlapped steps, and the unpenalised rows beside it the tokens they get without it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.models.conftest import six_decoding
from tests.models.test_generation import random_arrivals, serve
from tests.models.test_overlapped_steps import one_at_a_time, overlapped
from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

PENALISED = SamplingParams(24, 0.9, 0.95, 40, seed=7, presence_penalty=0.8,
                           frequency_penalty=0.6, repetition_penalty=1.4,
                           logit_bias=((11, 3.0), (12, -50.0)), min_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def alone(tiny: tuple[Any, Any], params: SamplingParams, prompt: str = "hello redis") -> list[int]:
    lm, tokenizer = tiny
    done, _, _ = serve(lm, tokenizer, {0: [("s", tokenizer(prompt).input_ids, params)]},
                       SchedulerLimits())
    return done["s"]


def test_a_bias_of_100_makes_the_model_emit_the_token(tiny: tuple[Any, Any]) -> None:
    assert alone(tiny, SamplingParams(8, logit_bias=((42, 100.0),))) == [42] * 8
    assert alone(tiny, SamplingParams(8, 1.0, seed=3, logit_bias=((42, 100.0),))) == [42] * 8


def test_min_tokens_holds_eos_off(tiny: tuple[Any, Any]) -> None:
    eos = tiny[1].eos_token_id
    tokens = alone(tiny, SamplingParams(20, logit_bias=((eos, 100.0),), min_tokens=5))
    assert len(tokens) == 6 and tokens[-1] == eos and eos not in tokens[:-1]


def test_penalties_change_tokens_and_are_the_same_in_a_crowded_batch(
        tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    single = alone(tiny, PENALISED)
    assert single != alone(tiny, SamplingParams(24, 0.9, 0.95, 40, seed=7))
    others = random_arrivals(random.Random(5), 8, 6, len(tokenizer))
    plain, _, _ = serve(lm, tokenizer, others, SchedulerLimits())
    others.setdefault(2, []).append(("s", tokenizer("hello redis").input_ids, PENALISED))
    crowded, preemptions, _ = serve(lm, tokenizer, others, SchedulerLimits(
        max_step_tokens=40, bytes_per_token=1024, kv_budget_bytes=1024 * 90))
    assert crowded.pop("s") == single and preemptions > 0
    assert crowded == plain  # the unpenalised rows beside it: their own tokens


def test_a_resumed_penalised_request_continues_as_if_never_stopped(
        tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    whole = alone(tiny, PENALISED)
    prompt = tokenizer("hello redis").input_ids
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    scheduler = DecodingScheduler(SchedulerLimits())
    engine.add("s", prompt, PENALISED)
    assert engine.resume("s", whole[:9], tokenizer.decode(whole[:9])) is None
    scheduler.add(SeqState("s", len(prompt), PENALISED.max_new_tokens, generated=9))
    while len(scheduler):
        scheduler.update(engine.step(scheduler.schedule()).finished)
    assert engine.seqs["s"].text.generated == whole


@pytest.mark.parametrize("gpu_shapes", [False, True], ids=["row-by-row", "gpu-shaped"])
def test_overlapped_penalised_steps_equal_steps_one_at_a_time(
        tiny: tuple[Any, Any], gpu_shapes: bool) -> None:
    def started() -> tuple[GenerationEngine, DecodingScheduler]:
        lm, tokenizer = tiny
        engine = GenerationEngine(lm, tokenizer, torch.device("cpu"),
                                  [tokenizer.eos_token_id], max_seqs=4, gpu_shapes=gpu_shapes)
        scheduler = DecodingScheduler(SchedulerLimits(max_seqs=4, max_step_tokens=24))
        for i in range(6):
            params = PENALISED if i % 2 else SamplingParams(12, frequency_penalty=1.0)
            ids = tokenizer(f"the stream {'of entries ' * i}{i}").input_ids
            engine.add(str(i), ids, params)
            scheduler.add(SeqState(str(i), len(ids), params.max_new_tokens))
        return engine, scheduler

    assert overlapped(*started()) == one_at_a_time(*started())


def test_a_penalised_decode_step_makes_one_copy_in_and_reads_nothing_back(
        tiny: tuple[Any, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine, plan = six_decoding(
        tiny, lambda i: PENALISED if i % 2 else SamplingParams(24, logit_bias=((5, 1.0),)))
    before = engine.buffers.copies
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(plan)
    assert not [e for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert engine.buffers.copies - before == 1  # the penalties' inputs ride in the upload
