"""`python -m bench.generative.step_profile`: what one engine step costs in operator calls,
copies and host syncs, row by row (a CPU's steps) against GPU-shaped (decodes padded to a
shape class, prefills packed), counted with the torch profiler on the same sequences.

On a GPU each operator is a kernel launch and a launch costs more than a small model's
arithmetic (bench/results/generative/2026-12-04-gpu-h200.md), so the count is the cost; on
CUDA the profiler also counts the kernels launched and the graph replays.

    python -m bench.generative.step_profile [--rows 16] [--device cpu] [--model smollm2]
        [--model-options JSON]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from worker.execution.generation import GenerationEngine
from worker.models import create_model
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState, StepPlan

PROMPT = "Redis streams carry inference requests to GPU workers, which batch them by length."


def counted(step: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """Operator calls (leaf aten ops), attention calls, host syncs, CUDA kernels of `step`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.events()
    names = collections.Counter(e.name for e in events)
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"aten ops": sum(n for name, n in names.items() if name.startswith("aten::")),
            "attention calls": names["aten::scaled_dot_product_attention"],
            "host syncs": names["aten::_local_scalar_dense"],
            "graph replays": names.get("cudaGraphLaunch", 0), "CUDA kernels": kernels}


def profile_steps(model: Any, rows: int, gpu_shapes: bool, capture: bool) -> dict[str, Any]:
    """A prefill step of `rows` prompts, then a decode step of `rows` sequences."""
    engine = GenerationEngine(model.lm, model.tokenizer, model.device, (),  # no EOS: all rows
                              max_seqs=rows, gpu_shapes=gpu_shapes)
    if capture:
        engine.capture_graphs()
    scheduler = DecodingScheduler(SchedulerLimits(max_seqs=rows, max_step_tokens=1 << 16))
    for i in range(rows):
        ids = model.tokenizer(f"{PROMPT} ({i})").input_ids
        engine.add(str(i), ids, SamplingParams(64, 0.8, 0.95, 50, seed=i))
        scheduler.add(SeqState(str(i), len(ids), 64))
    plans: list[StepPlan] = []

    def step() -> None:
        plans.append(scheduler.schedule())
        scheduler.update(engine.step(plans[-1]).finished)

    def copies(run: Callable[[], None]) -> dict[str, int]:
        buffers = engine.buffers
        before = buffers.copies, buffers.copies_back
        counts = counted(run, model.device)
        return counts | {"copies in": buffers.copies - before[0],
                         "copies back": buffers.copies_back - before[1]}

    prefill = copies(step)
    step()  # settle: the first decode step may allocate
    decode = copies(step)
    assert len(plans[0].prefill) == rows and len(plans[-1].decode) == rows
    return {"prefill": prefill, "decode": decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generative.step_profile",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-options", type=json.loads, default={}, help=(
        "JSON, e.g. '{\"path\": \"/a/model\"}' for causal_lm (the tests' tiny GPT-2)"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = create_model(args.model, args.model_options)
    model.load(torch.device(args.device))
    cuda = args.device.startswith("cuda")
    runs = {"row by row": profile_steps(model, args.rows, False, False),
            "GPU-shaped": profile_steps(model, args.rows, True, False)}
    if cuda:
        runs["GPU-shaped + graphs"] = profile_steps(model, args.rows, True, True)
    keys = list(runs["row by row"]["decode"])
    print(f"{args.model} on {args.device}, {args.rows} sequences: one prefill step of all of "
          "them, then one decode step")
    print("| step | path | " + " | ".join(keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for kind in ("prefill", "decode"):
        for path, run in runs.items():
            print(f"| {kind} | {path} | " + " | ".join(str(run[kind][k]) for k in keys) + " |")
    print("(copies in: host-to-device uploads of the step's inputs; copies back: "
          "device-to-host copies of its tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
