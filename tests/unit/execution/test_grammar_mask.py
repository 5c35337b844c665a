"""The grammar masks (execution/grammar_mask.py) on the tiny model's tokenizer: filled by
llguidance into the preallocated buffer (no new buffer per step), applied in one masked fill
to the constrained rows only, and the matchers advanced, replayed and failed as the engine
does; the gate holding a request until its grammar is in (or refusing it past its
time); the payload fields (models/structured_params.py) parsed and refused by name."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from producer.protocol import MSGPACK
from producer.request_entry import Request
from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.grammar_mask import GrammarMasks, words_of
from worker.models.base import InvalidInput, Prepared
from worker.models.generation_params import GenerationInput, SamplingParams
from worker.models.structured_params import (
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_DEPTH,
    Constraint,
    constraint_of,
)
from worker.pipeline.grammars import HELD, GrammarCompiler, GrammarGate, GrammarRefused
from worker.policy.batching import Pending
from worker.policy.decoding import Work

VOCAB = 320
DIGITS = Constraint("structured_outputs", "regex", "[0-9]{2}")


@dataclass
class Seq:
    id: str
    matcher: Any = None
    ended: bool = False


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_lm(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def fresh(compiler: GrammarCompiler, constraint: Constraint = DIGITS) -> Any:
    compiled = compiler.compile(constraint).result(timeout=10)
    assert not isinstance(compiled, str), compiled
    return compiled.deep_copy()


def emitting(count: int) -> list[Work]:
    return [Work(str(i), 4, 5, True) for i in range(count)]


def test_the_mask_keeps_only_the_grammars_tokens_on_the_constrained_rows(
        tokenizer: Any, compiler: GrammarCompiler) -> None:
    masks = GrammarMasks(VOCAB, torch.device("cpu"), rows=2)
    buffer = masks.host.data_ptr()
    seqs = [Seq("free"), Seq("digits", fresh(compiler)), Seq("done", fresh(compiler), True)]
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    assert masks.fill(seqs, emitting(3)) == 1 and masks.host.data_ptr() == buffer
    masked = masks.apply(logits, 1)
    digits = {i for i in range(VOCAB) if tokenizer.decode([i]).isdigit()
              and len(tokenizer.decode([i])) <= 2}
    allowed = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    assert allowed and allowed <= digits and masked is logits  # in place
    assert torch.equal(masked[1, sorted(allowed)], original[1, sorted(allowed)])
    assert torch.equal(masked[0], original[0]) and torch.equal(masked[2], original[2])
    half = masks.apply(original.to(torch.bfloat16), 1)  # the model's dtype: its own table
    assert set(torch.isfinite(half[1]).nonzero().flatten().tolist()) == allowed
    assert words_of(VOCAB) * 32 >= VOCAB and masks.words == words_of(VOCAB)


def test_more_rows_than_allocated_grow_the_buffer_once(compiler: GrammarCompiler) -> None:
    masks = GrammarMasks(VOCAB, torch.device("cpu"), rows=1)
    seqs = [Seq(str(i), fresh(compiler)) for i in range(3)]
    assert masks.fill(seqs, emitting(3)) == 3 and masks.rows >= 3
    buffer = masks.host.data_ptr()
    assert masks.fill(seqs, emitting(3)) == 3 and masks.host.data_ptr() == buffer
    assert torch.isinf(masks.apply(torch.zeros(3, VOCAB), 3)).any(dim=1).all()


def test_matchers_advance_replay_and_fail_by_sequence(tokenizer: Any,
                                                      compiler: GrammarCompiler) -> None:
    masks = GrammarMasks(VOCAB, torch.device("cpu"))
    ok, off, resumed = (Seq(name, fresh(compiler)) for name in ("ok", "off", "resumed"))
    for token in tokenizer("42", add_special_tokens=False).input_ids:
        masks.advance(ok, token)
    masks.advance(ok, tokenizer.eos_token_id)
    masks.advance(off, tokenizer("x", add_special_tokens=False).input_ids[0])
    masks.replay(resumed, tokenizer("4", add_special_tokens=False).input_ids)
    assert set(masks.failures()) == {"off"} and masks.failures() == {}
    assert ok.matcher.is_stopped() and not resumed.matcher.is_error()


def test_refused_grammars_are_cached_errors(compiler: GrammarCompiler) -> None:
    for constraint in (Constraint("structured_outputs", "lark", "start: (("),
                       Constraint("response_format", "json", '{"type": "strin"}')):
        first = compiler.compile(constraint)
        assert isinstance(first.result(timeout=10), str)
        assert compiler.compile(constraint) is first  # a repeat is refused at once


@pytest.mark.parametrize("payload, kind", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer"}}}}, "json"),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "lark"),
])
def test_the_payload_fields_become_one_constraint(payload: dict[str, Any],
                                                  kind: str | None) -> None:
    constraint = constraint_of(payload)
    assert (constraint.kind if constraint else None) == kind


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("payload, field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}}, "structured_outputs"),
    ({"structured_outputs": {"json": deep(MAX_SCHEMA_DEPTH)}}, "structured_outputs"),
    ({"structured_outputs": {"json": "[" * 40_000 + "]" * 40_000}}, "structured_outputs"),
], ids=["type", "schema-list", "both", "two-kinds", "bad-json", "no-choice", "too-long",
        "too-deep", "deep-text"])
def test_bad_fields_are_refused_naming_the_field(payload: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        constraint_of(payload)
    assert refused.value.details["field"] == field


def pending(entry_id: str, constraint: Constraint | None) -> Pending:
    data = GenerationInput([1], SamplingParams(4, constraint=constraint), stream=False)
    return Pending(entry_id, Request(entry_id, b"", MSGPACK, "reply", None), Prepared(1, data),
                   read_at=0.0)


def test_the_gate_holds_a_request_until_its_grammar_is_in_or_over_time(
        tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], threads=1)
    busy = threading.Event()
    compiler._pool.submit(busy.wait, 10)  # the one compile thread is taken: compiles queue
    woken: list[bool] = []
    gate = GrammarGate(compiler, lambda: woken.append(True), limit_s=0.2)
    slow = Constraint("structured_outputs", "regex", "[a-z]{3}")
    try:
        assert gate.take(pending("free", None), None) is None
        assert gate.take(pending("late", slow), None) is HELD and not gate.due()
        time.sleep(0.3)  # over its limit, still queued: refused, naming the field
        assert gate.due() and [p.entry_id for p, _ in gate.ready()] == ["late"]
        with pytest.raises(GrammarRefused) as refused:
            gate.take(pending("late", slow), None)
        assert refused.value.field == "structured_outputs" and "took over" in str(refused.value)
        assert gate.take(pending("next", slow), None) is HELD
        busy.set()
        compiler.compile(slow).result(timeout=10)
        assert woken and [p.entry_id for p, _ in gate.ready()] == ["next"]
        own = gate.take(pending("next", slow), None)
        assert own is not gate.take(pending("again", slow), None)  # each its own matcher
        assert own.consume_tokens(tokenizer("abc", add_special_tokens=False).input_ids)
    finally:
        busy.set()
        compiler.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_masks_come_from_the_pinned_buffer_in_one_copy_and_equal_the_cpus(
        compiler: GrammarCompiler) -> None:
    logits = torch.randn(4, VOCAB)
    seqs = [Seq(str(i), fresh(compiler) if i % 2 else None) for i in range(4)]
    cpu = GrammarMasks(VOCAB, torch.device("cpu"))
    on_cpu = cpu.apply(logits.clone(), cpu.fill(seqs, emitting(4)))
    cuda = GrammarMasks(VOCAB, torch.device("cuda"))
    assert cuda.host.is_pinned() and cuda.on_device.is_cuda
    on_gpu = cuda.apply(logits.cuda(), cuda.fill(seqs, emitting(4)))
    assert torch.equal(on_gpu.cpu(), on_cpu) and torch.isinf(on_cpu[1]).any()
    assert torch.equal(on_cpu[0], logits[0])
