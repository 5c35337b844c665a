"""The constrained mix: redbatch's engine on the generative workload, unconstrained against
half the requests under a JSON schema (structured outputs, llguidance), side by side at each
concurrency, in this process. Reports tokens/s of each, their ratio (issue 44's goal: the
mix at least 0.9x), the host's mask time per masked step (execution/grammar_mask.py: the
fill, llguidance's, and the copy), and how many constrained answers parse and validate.

`python -m bench.generative.constrained` alone, or `python -m bench.generative
--constrained-mix` beside the other systems. Greedy, as the other offline runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jsonschema
import torch

from bench.generative.workload import GenRequest, build_workload
from worker.execution.executor import device_precision
from worker.execution.generation import engine_for
from worker.models import create_model
from worker.models.generation_params import SamplingParams
from worker.models.structured_params import constraint_of
from worker.pipeline.grammars import GrammarCompiler
from worker.policy.decoding import DecodingScheduler, SeqState

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "maxItems": 4},
    "summary": {"type": "string", "maxLength": 160}},
    "required": ["topic", "sentiment", "keywords", "summary"], "additionalProperties": False}
FORMAT = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "note", "schema": SCHEMA, "strict": True}}}


def run_mix(model: Any, requests: Sequence[GenRequest], cap: int,
            compiler: GrammarCompiler | None) -> dict[str, Any]:
    """The engine stepped to the end, every request queued at once; with a compiler, every
    other request is under SCHEMA. Tokens/s, mask time per masked step, valid answers."""
    engine = engine_for(model, cuda_graphs=False)
    scheduler = DecodingScheduler(replace(model.scheduler_limits(), max_seqs=cap))
    constraint = constraint_of(FORMAT)
    template = compiler.compile(constraint).result() if compiler and constraint else None
    constrained: set[str] = set()
    for index, request in enumerate(requests):
        params = SamplingParams(request.max_new_tokens)
        matcher = None
        if template is not None and index % 2:
            params = replace(params, constraint=constraint)
            matcher = template.deep_copy()
            constrained.add(str(index))
        engine.add(str(index), request.prompt_ids, params, matcher=matcher)
        scheduler.add(SeqState(str(index), len(request.prompt_ids), request.max_new_tokens))
    tokens, valid, reasons, steps = 0, 0, {}, 0
    started = time.perf_counter()
    while len(scheduler):
        output = engine.step(scheduler.schedule())
        steps += 1
        reasons.update({d.id: d.finish_reason for d in output.deltas if d.finish_reason})
        for seq in scheduler.update(output.finished):
            done = engine.drop(seq.id)
            assert done is not None
            tokens += len(done.text.generated)
            valid += seq.id in constrained and _valid(done.text.text)
    seconds = time.perf_counter() - started
    masks = engine.masks
    return {"tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2), "steps": steps,
            "masked_steps": masks.fills, "constrained": len(constrained),
            "cut_by_length": sum(reasons.get(i) == "length" for i in constrained),
            "valid": valid, "mask_ms_per_masked_step":
                round(1000 * masks.fill_s / masks.fills, 3) if masks.fills else 0.0}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def constrained_mix(model: Any, requests: Sequence[GenRequest],
                    concurrency: Sequence[int]) -> dict[str, Any]:
    """Unconstrained and the half-constrained mix at each concurrency, one after the other."""
    compiler = GrammarCompiler(model.tokenizer, model.lm.config.vocab_size, model.eos_ids)
    results: dict[str, Any] = {"schema": SCHEMA}
    try:
        run_mix(model, requests[:4], 4, compiler)  # warm-up: the first run's allocations
        for cap in concurrency:
            plain, mixed = run_mix(model, requests, cap, None), run_mix(model, requests, cap,
                                                                        compiler)
            ratio = mixed["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens"] else 0
            results[str(cap)] = {"unconstrained": plain, "mixed": mixed,
                                 "ratio": round(ratio, 3)}
            print(f"c={cap}: unconstrained {plain['tokens_per_s']} tok/s, mixed "
                  f"{mixed['tokens_per_s']} tok/s ({ratio:.2f}x), mask "
                  f"{mixed['mask_ms_per_masked_step']} ms/step", file=sys.stderr)
    finally:
        compiler.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generative.constrained",
                                     description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-options", type=json.loads, default={})
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = create_model(args.model, {"max_seqs": max(args.concurrency), **args.model_options})
    model.dtype = getattr(torch, device_precision("auto", device, generative=True).dtype)
    model.load(device)
    requests = build_workload(model, args.prompts, args.seed)
    print(json.dumps(constrained_mix(model, requests, args.concurrency), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
