"""The batched decoding engine (worker/execution/generation.py) with the scheduler, on a
tiny GPT-2 built offline: continuous-batched greedy output equals `generate()` alone."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.detokenize import TextState
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.models.generative import kv_bytes_per_token
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState, StepPlan, Work

os.environ.setdefault("HF_HUB_OFFLINE", "1")
Arrival = tuple[str, list[int], SamplingParams]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    yield lm, AutoTokenizer.from_pretrained(path)


def reference(lm: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def serve(lm: Any, tokenizer: Any, arrivals: dict[int, list[Arrival]],
          limits: SchedulerLimits) -> tuple[dict[str, list[int]], int, int]:
    """Run the scheduler and engine until every arrival is done: (tokens per id,
    preemptions, the most sequences decoded in one step)."""
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    sched = DecodingScheduler(limits)
    done: dict[str, list[int]] = {}
    preemptions = widest = 0
    step = 0
    while step <= max(arrivals) or len(sched):
        for seq_id, prompt, params in arrivals.get(step, []):
            engine.add(seq_id, prompt, params)
            sched.add(SeqState(seq_id, len(prompt), params.max_new_tokens))
        step += 1
        plan = sched.schedule()
        if not plan:
            continue
        preemptions += len(plan.preempted)
        widest = max(widest, len(plan.decode))
        output = engine.step(plan)
        for seq in sched.update(output.finished):
            done[seq.id] = engine.seqs[seq.id].text.generated
            engine.drop(seq.id)
    return done, preemptions, widest


def random_arrivals(rng: random.Random, count: int, spread: int,
                    vocab: int) -> dict[int, list[Arrival]]:
    arrivals: dict[int, list[Arrival]] = {}
    for i in range(count):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 48))
        arrivals.setdefault(rng.randrange(spread), []).append((f"r{i}", prompt, params))
    return arrivals


SCENARIOS = {  # name: (seed, requests, arrival spread in steps, limits)
    "all_at_once": (1, 16, 1, SchedulerLimits(max_step_tokens=512, max_seqs=16)),
    "arrivals_while_running": (2, 24, 60, SchedulerLimits(max_step_tokens=64, max_seqs=6)),
    "chunked_prefill": (3, 16, 20, SchedulerLimits(max_step_tokens=12, max_seqs=8)),
    "forced_preemption": (4, 20, 30, SchedulerLimits(max_step_tokens=96, max_seqs=8,
                                                     bytes_per_token=1024,
                                                     kv_budget_bytes=1024 * 110)),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_continuous_batched_greedy_equals_generate_alone(tiny: tuple[Any, Any],
                                                         scenario: str) -> None:
    lm, tokenizer = tiny
    seed, count, spread, limits = SCENARIOS[scenario]
    arrivals = random_arrivals(random.Random(seed), count, spread, len(tokenizer))
    done, preemptions, widest = serve(lm, tokenizer, arrivals, limits)
    expected = {seq_id: reference(lm, prompt, params.max_new_tokens)
                for batch in arrivals.values() for seq_id, prompt, params in batch}
    mismatched = [i for i in expected if done[i] != expected[i]]
    assert not mismatched, f"{len(mismatched)}/{len(expected)} differ: {mismatched}"
    assert widest > 1, "sequences shared decode steps"
    if scenario == "forced_preemption":
        assert preemptions > 0


def test_kv_bytes_per_token_from_the_config(tiny: tuple[Any, Any]) -> None:
    lm, _ = tiny
    assert kv_bytes_per_token(lm.config, torch.float32) == 2 * 2 * 4 * 16 * 4


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    prompt = tokenizer("hello redis").input_ids
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=42)
    alone, _, _ = serve(lm, tokenizer, {0: [("s", prompt, params)]}, SchedulerLimits())
    others = random_arrivals(random.Random(9), 6, 5, len(tokenizer))
    others.setdefault(2, []).append(("s", prompt, params))
    crowded, _, _ = serve(lm, tokenizer, others, SchedulerLimits(
        max_step_tokens=40, bytes_per_token=1024, kv_budget_bytes=1024 * 90))
    assert crowded["s"] == alone["s"]
    other_seed, _, _ = serve(lm, tokenizer, {0: [("s", prompt, SamplingParams(
        max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=43))]},
        SchedulerLimits())
    assert other_seed["s"] != alone["s"]


def test_top_k_1_is_greedy(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    prompt = tokenizer("the quick brown").input_ids
    sampled, _, _ = serve(lm, tokenizer, {0: [("s", prompt, SamplingParams(
        max_new_tokens=12, temperature=1.5, top_k=1, seed=1))]}, SchedulerLimits())
    assert sampled["s"] == reference(lm, prompt, 12)


def spelled(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in tokens)


def test_a_stop_string_ends_the_text_and_is_never_streamed() -> None:
    state = TextState(SamplingParams(max_new_tokens=50, stop=("cde", "zz")), frozenset({25}))
    streamed = []
    for token in [0, 1, 2, 3, 4, 5]:  # a b c d e f
        delta = state.append("x", token, spelled)
        streamed.append(delta.text)
        if delta.finish_reason:
            break
    assert "".join(streamed) == "ab" and delta.finish_reason == "stop"
    assert streamed == ["a", "b", "", "", ""]  # "c", "cd" held back: they might start "cde"


def test_eos_and_max_new_tokens_finish() -> None:
    state = TextState(SamplingParams(max_new_tokens=3), frozenset({25}))
    assert state.append("x", 0, spelled).finish_reason is None
    assert state.append("x", 25, spelled).finish_reason == "stop"
    state = TextState(SamplingParams(max_new_tokens=2), frozenset({25}))
    state.append("x", 0, spelled)
    last = state.append("x", 1, spelled)
    assert (last.finish_reason, last.text, last.token_ids) == ("length", "b", [1])


def test_held_back_text_is_released_once_it_cannot_start_a_stop_string() -> None:
    state = TextState(SamplingParams(max_new_tokens=10, stop=("cx",)), frozenset())
    assert state.append("x", 2, spelled).text == ""  # "c" might start "cx"
    delta = state.append("x", 3, spelled)  # "cd": it cannot
    assert (delta.text, delta.token_ids) == ("cd", [2, 3])


def test_tiny_model_is_built_offline(tmp_path: Path) -> None:
    path = build_tiny_lm(tmp_path)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()


def test_a_prefilled_token_is_handed_out_before_the_step_s_other_forwards(
        tiny: tuple[Any, Any]) -> None:
    """on_prefilled sees each prefilled sequence's token while the running sequence's
    decode is still to come (the generate loop streams it at once)."""
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    engine.add("running", [5, 6, 7], SamplingParams(max_new_tokens=8))
    engine.step(StepPlan(prefill=[Work("running", 0, 3, True)]))
    engine.add("new", [9, 10, 11, 12], SamplingParams(max_new_tokens=8))
    seen: list[tuple[str, int]] = []
    plan = StepPlan(decode=[Work("running", 3, 4, True)], prefill=[Work("new", 0, 4, True)])
    output = engine.step(plan, lambda d: seen.append((d.id, engine.seqs["running"].cached)))
    assert seen == [("new", 3)]  # "running" had not decoded yet
    assert sorted(d.id for d in output.deltas) == ["new", "running"]
    assert engine.seqs["running"].cached == 4
