"""bench/generative/exactness.py's difference report on the tiny model: a forced difference
(a reference token changed) is reported with both tokens' text, through the tokenizer, and
rendered."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tests.rigs.tiny_lm import build_tiny_lm

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_a_forced_difference_is_reported_with_both_tokens_text(tmp_path: Path) -> None:
    from bench.generative.continuous import RecordingEngine, Request, serve
    from bench.generative.exactness import CPU, compare, noise, reference
    from bench.generative.exactness_report import markdown, summary
    from worker.models.generative import CausalLM
    from worker.policy.decoding import SchedulerLimits

    model = CausalLM(str(build_tiny_lm(tmp_path)))
    model.load(CPU)
    prompts = [model.tokenizer("hello redis").input_ids,
               model.tokenizer("the quick brown fox").input_ids]
    requests = [Request(f"p{i}", ids, 6, arrival=i) for i, ids in enumerate(prompts)]
    refs = {r.id: reference(model.lm, r.prompt_ids, r.max_new_tokens) for r in requests}
    wrong = (refs["p1"].tokens[2] + 1) % len(model.tokenizer)
    tokens = refs["p1"].tokens[:2] + [wrong] + refs["p1"].tokens[3:]
    refs["p1"] = dataclasses.replace(refs["p1"], tokens=tokens)  # a difference at step 2
    engine = RecordingEngine(model.lm, model.tokenizer, CPU, model.eos_ids,
                             {i: ref.tokens for i, ref in refs.items()})
    served = serve(engine, SchedulerLimits(), requests)
    differences, rows = compare(model, requests, refs, served)
    assert [(d.id, d.step, d.reference_token) for d in differences] == [("p1", 2, wrong)]
    found = differences[0]
    assert found.reference_text == model.tokenizer.decode([wrong])
    assert found.batched_text == model.tokenizer.decode([found.batched_token])
    assert found.batched_margin is not None and found.batched_margin > 0
    report = {"date": "today", "command": "test", "limits": {},
              "summary": summary(rows, differences, served), "noise": noise(refs, served),
              "timings_s": {"load": 0.0, "reference": 0.0, "batched": served.seconds}}
    assert f"| p1 | 2 | {wrong} {found.reference_text!r}" in markdown(report, differences)
