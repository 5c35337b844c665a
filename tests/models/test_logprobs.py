"""Logprobs through the engine (worker/execution/logprobs.py): the chosen token's and the
top alternatives' values equal torch.log_softmax of the model's own logits (before
penalties and temperature), they do not change any token, and a row's are the same alone
and in a crowded batch with preemptions, with overlapped steps too."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.models.conftest import six_decoding
from tests.models.test_generation import random_arrivals
from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]
SAMPLED = SamplingParams(16, 0.8, 0.9, 30, seed=11, logprobs=5, presence_penalty=1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def run(tiny: tuple[Any, Any], arrivals: Arrivals, limits: SchedulerLimits,
        overlap: bool = False) -> tuple[dict[str, list[int]], dict[str, list[dict[str, Any]]]]:
    """Every arrival to its end: (tokens, logprob records) by id; `overlap`: steps
    overlapped, shaped for a GPU (decodes padded, prefills packed)."""
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id],
                              gpu_shapes=overlap)
    scheduler = DecodingScheduler(limits)
    tokens: dict[str, list[int]] = {}
    records: dict[str, list[dict[str, Any]]] = {}
    step, previous = 0, None
    while step <= max(arrivals) or len(scheduler) or previous is not None:
        for seq_id, prompt, params in arrivals.get(step, []):
            engine.add(seq_id, prompt, params)
            scheduler.add(SeqState(seq_id, len(prompt), params.max_new_tokens))
        step += 1
        plan = scheduler.schedule() if len(scheduler) else None
        if overlap and plan:
            scheduler.update()  # as the generate loop: its tokens counted at the launch
        launched = engine.launch(plan) if plan else None
        finishing, previous = (previous, launched) if overlap else (launched, None)
        if finishing is None:
            continue
        output = engine.finish(finishing)
        for delta in output.deltas:
            records.setdefault(delta.id, []).extend(delta.logprobs or [])
        ended = [d.id for d in output.deltas if d.finish_reason]
        for seq_id in ended if overlap else [s.id for s in scheduler.update(ended)]:
            scheduler.remove(seq_id)
            tokens[seq_id] = engine.seqs[seq_id].text.generated
            engine.drop(seq_id)
    return tokens, records


def test_logprobs_equal_log_softmax_of_the_logits(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    prompt = tokenizer("hello redis").input_ids
    tokens, records = run(tiny, {0: [("s", prompt, SAMPLED)]}, SchedulerLimits())
    eos = tokenizer.eos_token_id
    kept = [t for t in tokens["s"] if t != eos]
    assert len(records["s"]) == len(kept) >= 4
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + tokens["s"]])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:]
    for at, (token, record) in enumerate(zip(kept, records["s"], strict=True)):
        assert record["logprob"] == pytest.approx(expected[at, token].item(), abs=1e-4)
        best = torch.topk(expected[at], 5)
        assert [r["logprob"] for r in record["top_logprobs"]] == pytest.approx(
            best.values.tolist(), abs=1e-4)
        assert [r["token"] for r in record["top_logprobs"]] == \
            [tokenizer.decode([i]) for i in best.indices.tolist()]
        text = bytes(record["bytes"]).decode(errors="replace")
        assert text == record["token"] == tokenizer.decode([token])


def test_logprobs_change_no_token_and_are_batch_invariant(tiny: tuple[Any, Any]) -> None:
    lm, tokenizer = tiny
    prompt = tokenizer("the quick brown fox").input_ids
    plain = SamplingParams(16, 0.8, 0.9, 30, seed=11, presence_penalty=1.0)
    without, none = run(tiny, {0: [("s", prompt, plain)]}, SchedulerLimits())
    alone, records = run(tiny, {0: [("s", prompt, SAMPLED)]}, SchedulerLimits())
    assert alone == without and not any(none.values())
    others = random_arrivals(random.Random(5), 8, 6, len(tokenizer))
    plain_others, _ = run(tiny, others, SchedulerLimits())
    others.setdefault(2, []).append(("s", prompt, SAMPLED))
    others[0].append(("w", prompt, SamplingParams(16, 0.8, 0.9, 30, seed=11, logprobs=20,
                                                  presence_penalty=1.0)))
    tight = SchedulerLimits(max_step_tokens=40, bytes_per_token=1024, kv_budget_bytes=1024 * 90)
    for overlap in (False, True):
        crowded, crowded_records = run(tiny, others, tight, overlap)
        assert crowded.pop("s") == crowded.pop("w") == alone["s"]
        assert crowded == plain_others  # the rows without logprobs: their own tokens
        assert _close(crowded_records["s"], records["s"])
        assert _close([{**r, "top_logprobs": r["top_logprobs"][:5]}
                       for r in crowded_records["w"]], records["s"])
        assert all(len(r["top_logprobs"]) == 20 for r in crowded_records["w"])


def _close(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """The same tokens, and logprobs within float32 noise of a different batch shape."""
    def flat(records: list[dict[str, Any]]) -> list[Any]:
        return [(r["token"], [t["token"] for t in r["top_logprobs"]]) for r in records]

    def values(records: list[dict[str, Any]]) -> list[float]:
        return [v for r in records for v in [r["logprob"]] + [t["logprob"] for t in
                                                                r["top_logprobs"]]]
    return flat(got) == flat(want) and values(got) == pytest.approx(values(want), abs=1e-4)


def test_a_logprobs_step_copies_once_each_way_and_reads_nothing_else_back(
        tiny: tuple[Any, Any]) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine, plan = six_decoding(
        tiny, lambda i: SAMPLED if i % 2 else SamplingParams(24, logprobs=i))
    copies, back = engine.buffers.copies, engine.buffers.copies_back
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        launched = engine.launch(plan)
    assert not [e for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert engine.buffers.copies - copies == 1 and engine.buffers.copies_back - back == 1
    assert launched.tokens is not None  # the tokens, then the tails, width 5:
    assert launched.tokens.numel() == 6 + 6 * (1 + 2 * 5)
    output = engine.finish(launched)
    # a delta may carry a record held back with its text (a character split over tokens)
    records = [r for d in output.deltas for r in d.logprobs or []]
    assert records and all({"token", "logprob", "bytes", "top_logprobs"} <= set(r)
                           for r in records)
