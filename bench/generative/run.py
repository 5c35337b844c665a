"""The generative benchmark: `python -m bench.generative` (or `python -m bench --generative`).

One run, side by side on the same requests (bench/generative/workload.py: real prompts, a
long-tailed max_new_tokens mix over 8-256), repeated `--repeats` times in turn:

- redbatch: one worker process (continuous batching, max_seqs = the largest concurrency)
  on an embedded Redis, fed closed-loop at each concurrency (bench/generative/online.py);
- in this process (bench/generative/offline.py): redbatch's engine alone, static run-to-completion
  batching at the same cap, and transformers' own continuous batching (generate_batch's
  manager).
Then time to first token, unloaded and under open-loop arrivals at 50 % and 80 % of the
saturated request rate, and the worker's peak RSS against weights + KV budget.
Medians over the repeats; the machine is shared, so only side-by-side ratios mean much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.machine import describe_machine
from bench.common.paths import results_dir
from bench.common.processes import Workers
from bench.common.stats import median
from bench.generative.constrained import constrained_mix
from bench.generative.offline import agreement, run_engine, run_generate_batch, run_hf_static
from bench.generative.online import RssPeak, closed_loop
from bench.generative.report import markdown, memory_check
from bench.generative.ttft import time_to_first_token
from bench.generative.workload import GenRequest, build_workload, describe
from worker.execution.executor import device_precision
from worker.models import create_model
from worker.policy.precision import DTYPES
from worker.streams.server import RedisServer

RESULTS = results_dir("generative")
SYSTEMS = ("redbatch", "engine", "static", "hf_static", "generate_batch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.generative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-options", type=json.loads, default={},
                        help="JSON, e.g. '{\"path\": \"/a/model\"}' for causal_lm")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help=(
        "torch threads, everywhere (1: on a shared machine 2 threads can run 10x slower)"))
    parser.add_argument("--workers", type=int, default=1, help=(
        "redbatch worker processes, each with --threads torch threads and its own KV cache "
        "(2 on a 2-core machine: two prompts that arrive together prefill side by side)"))
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--device", default="cpu", help=(
        "where every system runs: the worker (its --device) and the in-process ones, e.g. cuda"))
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=(
        "the weights' and KV pool's dtype, for every system (auto: the device's, as the "
        "worker resolves it)"))
    parser.add_argument("--ttft-only", action="store_true", help=(
        "skip the systems' throughput: saturation from one closed-loop redbatch run at the "
        "largest concurrency, then TTFT and memory"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--constrained-mix", action="store_true", help=(
        "also run the engine unconstrained against half the requests under a JSON schema, "
        "at each concurrency (bench/generative/constrained.py)"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_seqs": max(args.concurrency), "kv_cache_bytes": args.kv_cache_mib << 20,
            **args.model_options}


def throughput(model: Any, requests: Sequence[GenRequest], pool: Workers,
               args: argparse.Namespace) -> dict[str, Any]:
    """Generated tokens/s of each system at each concurrency, every repeat in turn."""
    rates: dict[int, dict[str, list[float]]] = {c: {s: [] for s in SYSTEMS}
                                                 for c in args.concurrency}
    agreeing: dict[str, float] = {}
    generated = 0
    for repeat in range(args.repeats):
        for cap in args.concurrency:
            runs = {"redbatch": closed_loop(pool.redis_url, pool.stream, requests, cap),
                    "engine": run_engine(model, requests, cap),
                    "static": run_engine(model, requests, cap, static=True),
                    "hf_static": run_hf_static(model, requests, cap),
                    "generate_batch": run_generate_batch(model, requests, cap)}
            generated = runs["redbatch"].tokens
            for system, run in runs.items():
                rates[cap][system].append(run.tokens_per_s)
            if repeat == 0 and cap == max(args.concurrency):
                agreeing = {"engine_vs_static": agreement(runs["engine"], runs["static"]),
                            "engine_vs_hf_static": agreement(runs["engine"], runs["hf_static"]),
                            "engine_vs_generate_batch": agreement(runs["engine"],
                                                                  runs["generate_batch"])}
            print(f"repeat {repeat} c={cap}: " + ", ".join(
                f"{s} {r.tokens_per_s:.1f}" for s, r in runs.items()), file=sys.stderr)
    table = {cap: {s: {"median": median(v), "runs": v} for s, v in by.items()}
             for cap, by in rates.items()}
    return {"tokens_per_s": table, "greedy_agreement": agreeing,
            "mean_generated_tokens": generated / len(requests)}


def saturation(model: Any, requests: Sequence[GenRequest], pool: Workers,
               args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """The saturated request rate: redbatch's tokens/s at the largest concurrency over the
    mean tokens generated (from the throughput runs, or one run of its own)."""
    cap = max(args.concurrency)
    if args.ttft_only:
        run = closed_loop(pool.redis_url, pool.stream, requests, cap)
        tokens_per_s, mean_tokens = run.tokens_per_s, run.tokens / len(requests)
    else:
        results["throughput"] = throughput(model, requests, pool, args)
        tokens_per_s = results["throughput"]["tokens_per_s"][cap]["redbatch"]["median"]
        mean_tokens = results["throughput"]["mean_generated_tokens"]
    return {"tokens_per_s": tokens_per_s, "requests_per_s": tokens_per_s / mean_tokens,
            "mean_generated_tokens": mean_tokens}


def measure(args: argparse.Namespace, model: Any, requests: list[GenRequest],
            log_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with RedisServer(log_dir, appendonly=False) as server, \
            Workers(server.url, "redbatch", args.workers, log_dir, model=args.model,
                    model_options=model_options(args), torch_threads=args.threads,
                    device=args.device, dtype=args.dtype) as pool:
        pool.wait_until_reading(timeout_s=600)
        warm_up = 2 * args.workers  # a request or two for each worker
        closed_loop(pool.redis_url, pool.stream, requests[:warm_up], warm_up)
        with RssPeak(pool.processes[0].pid) as rss:
            results["saturation"] = saturation(model, requests, pool, args, results)
            results["ttft_ms"] = time_to_first_token(
                pool.redis_url, pool.stream, requests,
                results["saturation"]["requests_per_s"], args.seed)
        results["memory"] = memory_check(model, args.kv_cache_mib << 20, rss)
    return results


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return str(device)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    precision = device_precision(args.dtype, device, generative=True)
    model = create_model(args.model, model_options(args))
    model.dtype = getattr(torch, precision.dtype)
    model.load(device)
    requests = build_workload(model, args.prompts, args.seed)
    results: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.generative", *(argv or sys.argv[1:])]),
        "machine": describe_machine(), "model": args.model, "workload": describe(requests),
        "threads": args.threads, "workers": args.workers, "kv_cache_mib": args.kv_cache_mib,
        "device": describe_device(device), "dtype": precision.describe()}
    with tempfile.TemporaryDirectory(prefix="redbatch-gen-bench-") as log_dir:
        results.update(measure(args, model, requests, Path(log_dir)))
    if args.constrained_mix:
        results["constrained_mix"] = constrained_mix(model, requests, args.concurrency)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-generative-{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown(results)
    stem.with_suffix(".md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
