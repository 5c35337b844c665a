"""Constrained generations survive their worker: kill -9 of a worker in the middle of
requests under a regex and a JSON schema (and plain ones beside them), its steps overlapped
as on a GPU; each stream is resumed by another worker, whose matcher is rebuilt from the
streamed tokens, and ends whole, as uninterrupted and matching its grammar.

Real `python -m worker` processes on the tiny GPT-2, a real Redis (the rig of
test_generation_durability.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import redis

from tests.redis.single.test_generation_durability import (  # noqa: F401
    STREAM,
    Spawn,
    check_stream,
    entries_of,
    kill_mid_generation,
    reference,
    spawn,
    tiny_path,
    wait_done,
)
from tests.redis.single.test_generation_e2e import send, stream_key
from tests.rigs.chaos import heaviest_on_redis_7_only, wait_until
from tests.rigs.tiny_lm import engine_text
from worker.models.generation_params import SamplingParams
from worker.models.structured_params import constraint_of
from worker.pipeline.grammars import GrammarCompiler

WORDS = "([a-z]{2,6} ){12,30}"  # long enough for a kill to land mid-generation
SCHEMA = {"type": "object", "properties": {"words": {
    "type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 8,
    "maxItems": 12}}, "required": ["words"], "additionalProperties": False}
GRAMMARS = [{"structured_outputs": {"regex": WORDS}},
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "w", "schema": SCHEMA}}}]
PROMPTS = ["the quick brown fox", "redis streams carry requests", "hello world, hello"]


def expected(reference: tuple[Any, Any], payload: dict[str, Any],  # noqa: F811
             compiler: GrammarCompiler) -> str:
    params = SamplingParams(payload["max_new_tokens"], constraint=constraint_of(payload))
    matcher = None
    if params.constraint is not None:
        matcher = compiler.compile(params.constraint).result(timeout=10).deep_copy()
    return engine_text(*reference, payload["prompt"], params, matcher)


@pytest.mark.slow
def test_kill_9_mid_constrained_generation_resumes_whole_identical_and_valid(
        spawn: Spawn, r: redis.Redis, reference: tuple[Any, Any]) -> None:  # noqa: F811
    heaviest_on_redis_7_only(r)
    lm, tokenizer = reference
    compiler = GrammarCompiler(tokenizer, lm.config.vocab_size, [tokenizer.eos_token_id])
    workers = {name: spawn(name, overlap_steps=True) for name in ("w0", "w1")}
    for worker in workers.values():
        worker.wait_serving()
    resumed = 0
    try:
        for trial in range(1):  # a kill lands mid-generation: see kill_mid_generation
            wait_until(lambda: all(w.logged("worker.serving") and w.process.poll() is None
                                   for w in workers.values()), 60, "two serving workers")
            payloads = [{"prompt": PROMPTS[(trial + k) % 3], "max_new_tokens": 60, **g}
                        for k, g in enumerate([*GRAMMARS, {}])]
            keys = [stream_key(send(r, p)) for p in payloads]
            victim, _ = kill_mid_generation(r, workers, keys)
            workers[victim] = spawn(victim, overlap_steps=True)
            wait_done(r, keys, 60)
            for key, payload in zip(keys, payloads, strict=True):
                want = expected(reference, payload, compiler)
                figures = check_stream(r, key, want)
                assert figures["complete"] == figures["identical"] == 1, (payload, figures)
                resumed += figures["resumed"]
                done = entries_of(r, key)[-1][1]["result"]
                if done["finish_reason"] == "stop" and "structured_outputs" in payload:
                    assert re.fullmatch(WORDS, done["text"])
                elif done["finish_reason"] == "stop" and "response_format" in payload:
                    jsonschema.validate(json.loads(done["text"]), SCHEMA)
        wait_until(lambda: r.xpending(STREAM, "workers")["pending"] == 0, 10, "all acked")
        assert resumed >= 1  # a kill did land mid-generation
    finally:
        compiler.close()
