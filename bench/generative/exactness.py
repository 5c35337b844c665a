"""Exactness of continuous batching on the real model (issue 12): SmolLM2's continuous-batched
greedy output must equal transformers `generate(do_sample=False)` on each prompt alone, token
for token, in >= 99% of cases. Every difference is reported with the logit margin at its first
differing step, in the reference run and in the batched run, so a near-tie (float
non-associativity: chunked, padded and recomputed forwards sum in another order) can be told
apart from a bug (a large margin).

    python -m bench.generative.exactness [--prompts N] [--seed S] [--out DIR]
        [--device cuda] [--dtype bfloat16] [--model causal_lm --model-options JSON]

Writes DIR/2026-12-01-smollm2-exactness.{json,md} (float32 on the CPU; another device or dtype
adds both to the name, another model its name and the date). One torch thread: the machine is
shared. In a 16-bit dtype the reference is generate() in that dtype, and a near-tie is a margin
within NEAR_TIE_ULPS of that dtype's rounding steps at the top logit's size (float32:
NEAR_TIE).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common.paths import SENTENCES, results_dir
from bench.generative.continuous import RecordingEngine, Request, Served, serve
from bench.generative.exactness_report import NEAR_TIE, TOPK, Difference, markdown, summary
from worker.models.generative import kv_bytes_per_token
from worker.policy.decoding import SchedulerLimits

RESULTS = results_dir("generative")
NAME = "2026-12-01-smollm2-exactness"
SENTENCE_COUNTS = (1, 1, 1, 1, 2, 2, 2, 3, 4, 6, 9, 12)  # a long tail of prompt lengths
NEAR_TIE_ULPS = 2  # in a 16-bit dtype: two rounding steps (measured: differences at 1-2)
CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Reference:
    tokens: list[int]
    top: list[tuple[list[float], list[int]]]  # per step: the TOPK best logits, their tokens


def near_tie_threshold(dtype: torch.dtype, top_logit: float) -> float:
    """NEAR_TIE in float32; in a 16-bit dtype, NEAR_TIE_ULPS of its rounding steps at the
    top logit's magnitude (bfloat16 keeps 8 significant bits: a step of 0.125 at 20)."""
    if dtype == torch.float32:
        return NEAR_TIE
    step = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(top_logit) or 1.0))
    return max(NEAR_TIE, NEAR_TIE_ULPS * step)


def load_model(device: torch.device = CPU, dtype: torch.dtype = torch.float32,
               name: str = "smollm2", options: Mapping[str, Any] | None = None) -> Any:
    """SmolLM2 by default; any causal LM model (e.g. causal_lm on the tests' tiny GPT-2)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker.models import create_model

    model = create_model(name, dict(options or {}))
    model.dtype = dtype
    model.load(device)
    return model


def build_requests(model: Any, count: int, seed: int, max_new: int = 48, spread: int = 3,
                   sentences_per_prompt: Sequence[int] = SENTENCE_COUNTS) -> list[Request]:
    """Real prompts (raw or chat) of a seeded number of sentences, tokenised by the worker's
    own prepare(), arriving at seeded steps over `spread` x `count` steps, max_new_tokens
    drawn from 1..max_new."""
    rng = random.Random(seed)
    sentences = [s.strip() for s in SENTENCES.read_text().splitlines() if s.strip()]
    arrivals = sorted(rng.randrange(spread * count) for _ in range(count))
    requests = []
    for i, arrival in enumerate(arrivals):
        text = " ".join(rng.sample(sentences, rng.choice(sentences_per_prompt)))
        kind = rng.choice(("raw", "chat"))
        payload: dict[str, Any] = {"prompt": text} if kind == "raw" else \
            {"messages": [{"role": "user", "content": text}]}
        payload["max_new_tokens"] = rng.randint(1, max_new)
        data = model.prepare(payload, len(text)).data
        requests.append(Request(f"p{i:03d}", data.prompt_ids, data.params.max_new_tokens,
                                arrival, kind))
    return requests


def reference(lm: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> Reference:
    """generate(do_sample=False) on the prompt alone, with the best logits of each step."""
    ids = torch.tensor([list(prompt_ids)], device=lm.device)
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, output_logits=True,
                          return_dict_in_generate=True)
    tokens = [int(t) for t in out.sequences[0, len(prompt_ids):]]
    top = []
    for step in out.logits:
        values, indices = torch.topk(step[0].float(), TOPK)
        top.append(([float(v) for v in values], [int(i) for i in indices]))
    return Reference(tokens, top)


def scheduler_limits(model: Any, requests: Sequence[Request], max_step_tokens: int,
                     max_seqs: int, kv_tokens: int) -> SchedulerLimits:
    """A small KV budget (in tokens, raised to what the longest request needs alone), so
    sequences are preempted and recomputed."""
    need = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in requests)
    per_token = kv_bytes_per_token(model.lm.config, model.lm.dtype)
    return SchedulerLimits(max_step_tokens=max_step_tokens, max_seqs=max_seqs,
                           bytes_per_token=per_token,
                           kv_budget_bytes=per_token * max(kv_tokens, need))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def difference(model: Any, request: Request, ref: Reference, served: Served,
               step: int) -> Difference:
    got = served.tokens[request.id]
    mine, theirs = ref.tokens[step], got[step]
    values, indices = ref.top[step]
    exact = theirs in indices
    margin = values[0] - (values[indices.index(theirs)] if exact else values[-1])
    noted = served.emitted[request.id][step]
    batched = noted.top - noted.expected if noted.expected is not None else None
    return Difference(request.id, request.kind, len(request.prompt_ids),
                      request.max_new_tokens, step, mine, theirs,
                      token_text(model, mine), token_text(model, theirs), margin, exact, batched,
                      near_tie_threshold(model.lm.dtype, values[0]), noted.path, noted.width,
                      noted.preempted,
                      served.chunks.get(request.id, 0), served.preemptions.get(request.id, 0))


def token_text(model: Any, token: int) -> str:
    """One token's text, through the model's tokenizer (special tokens shown as such)."""
    return str(model.tokenizer.decode([token]))


def noise(refs: Mapping[str, Reference], served: Served) -> dict[str, Any]:
    """|batched - reference| top-1 logit where both runs chose the same token, by path;
    and how close the reference's own top-2 came (how many near-ties the prompts hold)."""
    drift: dict[str, list[float]] = {}
    gaps: list[float] = []
    for seq_id, ref in refs.items():
        gaps += [values[0] - values[1] for values, _ in ref.top]
        for step, noted in enumerate(served.emitted.get(seq_id, [])):
            if step >= len(ref.tokens) or noted.token != ref.tokens[step]:
                break  # past the first difference the two runs see different tokens
            key = noted.path + (" after preemption" if noted.preempted else "")
            drift.setdefault(key, []).append(abs(noted.top - ref.top[step][0][0]))
    return {"top1_drift": {k: {"steps": len(v), "median": statistics.median(v), "max": max(v)}
                           for k, v in sorted(drift.items())},
            "reference_steps": len(gaps),
            "reference_top2_gap_below_near_tie": sum(g < NEAR_TIE for g in gaps),
            "reference_top2_gap_min": min(gaps)}


def compare(model: Any, requests: Sequence[Request], refs: Mapping[str, Reference],
            served: Served) -> tuple[list[Difference], list[dict[str, Any]]]:
    differences, rows = [], []
    for request in requests:
        got = served.tokens[request.id]
        step = first_difference(refs[request.id].tokens, got)
        if step is not None:
            differences.append(difference(model, request, refs[request.id], served, step))
        rows.append({"id": request.id, "kind": request.kind,
                     "prompt_len": len(request.prompt_ids),
                     "max_new_tokens": request.max_new_tokens, "generated": len(got),
                     "match": step is None, "chunks": served.chunks.get(request.id, 0),
                     "preemptions": served.preemptions.get(request.id, 0)})
    return differences, rows


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.generative.exactness",
                                     description=__doc__)
    parser.add_argument("--prompts", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="a causal LM model of the worker's")
    parser.add_argument("--model-options", type=json.loads, default={}, help=(
        "JSON, e.g. '{\"path\": \"/a/model\"}' for causal_lm (the tests' tiny GPT-2)"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--max-step-tokens", type=int, default=32)
    parser.add_argument("--max-seqs", type=int, default=8)
    parser.add_argument("--kv-tokens", type=int, default=384)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--gpu-shapes", action="store_true", help=(
        "steps shaped for a GPU (decodes padded to shape classes, prefills packed) on any "
        "device; a CUDA device uses them anyway"))
    parser.add_argument("--overlap", action="store_true", help=(
        "step n + 1 launched before step n's tokens are read, as the generate loop does on "
        "a GPU"))
    return parser.parse_args(argv)


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces the run (a flag alone for a switch that is on)."""
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {flag_value(v)}")
             for k, v in vars(args).items() if k != "out" and v is not False and v != {}]
    return "python -m bench.generative.exactness " + " ".join(flags)


def flag_value(value: Any) -> str:
    """A flag's value as typed on a command line (JSON options quoted for the shell)."""
    return f"'{json.dumps(value)}'" if isinstance(value, dict) else str(value)


def report_name(device: torch.device, dtype: str, gpu_shapes: bool, overlap: bool,
                model: str = "smollm2") -> str:
    if model == "smollm2" and device.type == "cpu" and dtype == "float32" and not gpu_shapes \
            and not overlap:
        return NAME  # the stored report, rewritten by a rerun
    shaped = "-gpu-shapes" if gpu_shapes and device.type == "cpu" else ""
    shaped += "-overlap" if overlap else ""
    model = re.sub(r"[^\w-]", "-", model)  # a plugin's 'package.module:Class' as a file name
    return f"{datetime.date.today().isoformat()}-{model}-exactness-{dtype}-{device.type}{shaped}"


def tie_rule(dtype: str) -> str:
    if dtype == "float32":
        return str(NEAR_TIE)
    return f"{NEAR_TIE_ULPS} {dtype} rounding steps at the top logit (at least {NEAR_TIE})"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    device = torch.device(args.device)
    model = load_model(device, getattr(torch, args.dtype), args.model, args.model_options)
    loaded = time.perf_counter()
    requests = build_requests(model, args.prompts, args.seed, args.max_new)
    refs = {r.id: reference(model.lm, r.prompt_ids, r.max_new_tokens) for r in requests}
    referenced = time.perf_counter()
    limits = scheduler_limits(model, requests, args.max_step_tokens, args.max_seqs,
                              args.kv_tokens)
    engine = RecordingEngine(model.lm, model.tokenizer, device, model.eos_ids,
                             {i: ref.tokens for i, ref in refs.items()},
                             gpu_shapes=args.gpu_shapes or None)
    served = serve(engine, limits, requests, overlap=args.overlap)
    differences, rows = compare(model, requests, refs, served)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": command(args), "model": args.model, "dtype": args.dtype,
              "summary": summary(rows, differences, served),
              "limits": {**asdict(limits), "kv_tokens": limits.kv_tokens},
              "noise": noise(refs, served), "near_tie_threshold": tie_rule(args.dtype),
              "timings_s": {"load": loaded - started, "reference": referenced - loaded,
                            "batched": served.seconds},
              "differences": [{**asdict(d), "near_tie": d.near_tie} for d in differences],
              "requests": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = report_name(device, args.dtype, args.gpu_shapes, args.overlap, args.model)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(report, differences))
    print(markdown(report, differences))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
