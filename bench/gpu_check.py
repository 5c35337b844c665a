"""`python -m bench.gpu_check`: the GPU paths, checked on a real device in one command.

Eight checks, in the dtype `--dtype` resolves to (auto: bfloat16 on CUDA >= 8.0, float16
below), which the first line reports; `--checks` picks some (the first five, MiniLM's, within
6 minutes on one GPU; the generative three within 5 more):
  overlap     CUDA event timings: the next batch's copy happens during this batch's compute
  governor    a ballast allocation leaves little free memory: the caps are cut, and grow back
  oom split   a batch far too large for the memory left is split until it fits; all answered
  throughput  MiniLM through the worker (embedded Redis), with one and two model instances
              (each on its own CUDA streams), against the same model run offline
  vs ST       on thousands of mixed-length texts: redbatch at default settings through Redis
              (its own process, 3 rounds of 32,000 requests; CUDA graphs used or not), its
              own offline limit in the same dtype (forward only, and end to end with
              tokenising), and sentence-transformers' encode at batch 32/128/512 in float32
              and float16, with the goals of issue 31 (bench/throughput/gpu_compare.py)
  generative  SmolLM2: redbatch through Redis, its engine in-process, transformers'
              generate_batch and static generate() at concurrency 64 (128 prompts), then TTFT
              unloaded and at 50 % and 80 % load (bench/generative/run.py, on this device)
  generative-16  the same at concurrency 16 (32 prompts)
  exactness   the engine against generate() on each prompt alone, both in this dtype, every
              difference with its margin in the dtype's rounding steps
              (bench/generative/exactness.py)
Reports of the last three go to `--out` (the generative ones in c64/ and c16/).
Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.common.paths import SENTENCES
from bench.throughput.gpu_compare import compare
from worker.execution.executor import Executor, Launched, device_precision, to_device
from worker.execution.guarded_runner import BatchRunner, TooLarge
from worker.execution.memory import CudaMemory
from worker.models import Model, create_model
from worker.models.base import Prepared
from worker.policy.batching import BatchLimits
from worker.policy.governor import Governor, GovernorPolicy
from worker.policy.precision import DTYPES

GIB = 1 << 30
BUCKET_256 = 4  # MiniLM's bucket for 129..256 tokens


def say(line: str = "") -> None:
    print(line, flush=True)


def samples(model: Model, count: int, length: int = 256) -> list[Prepared]:
    sample = model.sample(length)
    assert sample is not None, "MiniLM has a sample()"
    return [sample] * count


def check_overlap(model: Model, device: torch.device, batches: int = 6) -> None:
    """Stage batch k+1 while batch k computes, as the worker does; read the event timings."""
    executor = Executor(model, device, timing=True)
    items = samples(model, 128)
    executor.run(items, BUCKET_256)  # warm
    launched: list[Launched] = []
    current = executor.launch(executor.stage(items, BUCKET_256))
    for _ in range(batches - 1):
        upcoming = executor.stage(items, BUCKET_256)
        executor.finish(current)
        launched.append(current)
        current = executor.launch(upcoming)
    executor.finish(current)
    launched.append(current)
    origin = launched[0].staged.copy_started
    say("batch  copy start..end ms   compute start..end ms   (from the first copy)")
    overlapped = 0
    for k, batch in enumerate(launched):
        copy = (origin.ms_until(batch.staged.copy_started), origin.ms_until(batch.staged.copied))
        compute = (origin.ms_until(batch.compute_started), origin.ms_until(batch.done))
        say(f"{k:>5}  {copy[0]:8.2f}..{copy[1]:8.2f}      {compute[0]:8.2f}..{compute[1]:8.2f}")
        if k and copy[1] <= origin.ms_until(launched[k - 1].done):
            overlapped += 1
    say(f"overlap: {overlapped} of {len(launched) - 1} copies finished while the previous "
        "batch was still computing")


def governed_runner(model: Model, device: torch.device, limits: BatchLimits) -> BatchRunner:
    policy = GovernorPolicy(grow_after_s=0.0, forgive_after_s=0.0)
    governor = Governor(limits, BUCKET_256 + 2, policy)
    return BatchRunner(Executor(model, device), governor, CudaMemory(device), "gpu_check")


def ballast_leaving(device: torch.device, free_bytes: int) -> torch.Tensor:
    """One allocation that leaves `free_bytes` free on the device (and none cached)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return torch.empty(max(0, free - free_bytes), dtype=torch.uint8, device=device)


def caps_of(runner: BatchRunner) -> str:
    cap = runner.governor.caps[BUCKET_256]
    return f"{cap.requests} requests / {cap.tokens} tokens"


def check_governor(model: Model, device: torch.device) -> None:
    runner = governed_runner(model, device, BatchLimits(128, 32768, 0.005))
    items = samples(model, 32)
    runner.run(BUCKET_256, items)
    say(f"no ballast:   memory {runner.memory.read().fraction:6.1%}, cap {caps_of(runner)}")
    total = torch.cuda.mem_get_info(device)[1]
    ballast = ballast_leaving(device, int(0.04 * total))
    for _ in range(3):
        runner.run(BUCKET_256, items)
    say(f"ballast {ballast.numel() / GIB:.0f} GiB: memory {runner.memory.read().fraction:6.1%}, "
        f"cap {caps_of(runner)}")
    del ballast
    torch.cuda.empty_cache()
    rounds = 0
    while runner.governor.caps != runner.governor.base and rounds < 50:
        runner.run(BUCKET_256, items)
        rounds += 1
    say(f"ballast freed: memory {runner.memory.read().fraction:6.1%}, cap {caps_of(runner)} "
        f"after {rounds} batches")


def check_oom_split(model: Model, device: torch.device, size: int = 4096) -> None:
    runner = governed_runner(model, device, BatchLimits(size, size * 256, 0.005))
    runner.governor.policy = replace(runner.governor.policy, grow_after_s=3600.0)
    ballast = ballast_leaving(device, 2 * GIB)
    items = samples(model, size)
    started = time.perf_counter()
    results = runner.run(BUCKET_256, items)
    seconds = time.perf_counter() - started
    del ballast
    torch.cuda.empty_cache()
    answered = sum(1 for r in results if not isinstance(r, TooLarge))
    say(f"batch of {size} x 256 tokens with 2 GiB free: {runner.oom_events} OOM events, "
        f"{runner.splits} splits, {answered}/{size} answered in {seconds:.1f} s, "
        f"cap now {caps_of(runner)}, smallest failed "
        f"{runner.governor.ceilings[BUCKET_256].smallest_failed} tokens")


def offline_throughput(model: Model, device: torch.device, texts: Sequence[str],
                       batch_size: int) -> float:
    """The same model in a plain loop: no queue, no batcher, no streams."""
    items = [model.prepare({"text": text}, len(text)) for text in texts]
    started = time.perf_counter()
    with torch.inference_mode():
        for at in range(0, len(items), batch_size):
            chunk = items[at:at + batch_size]
            model.postprocess(model.forward(to_device(model.collate(chunk), device)), chunk)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(items) / (time.perf_counter() - started)


def serve_and_time(worker: Any, url: str, model_name: str,
                   texts: Sequence[str]) -> tuple[float, list[dict[str, Any]]]:
    """Run the worker in a thread, send every text at once through Redis after one warm
    request, and time until the last reply; (seconds, envelopes)."""
    from producer import Client

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = Client(url, model_name)
    client.infer({"text": "warm"}, timeout=60)
    reply_to = client.new_reply_key()
    started = time.perf_counter()
    client.submit_many(({"text": text} for text in texts), reply_to=reply_to)
    envelopes = client.collect(reply_to, len(texts), timeout=120)
    seconds = time.perf_counter() - started
    worker.stop()
    thread.join(timeout=30)
    return seconds, envelopes


def worker_throughput(model: Model, device: torch.device, texts: Sequence[str],
                      batch_size: int, instances: int = 1) -> float:
    """Through Redis and the worker, as a producer sees it: submit all, wait for all."""
    from worker.app import assemble_worker, connect
    from worker.settings import load_settings
    from worker.streams.server import RedisServer

    with tempfile.TemporaryDirectory() as data, RedisServer(Path(data)) as server:
        settings = load_settings(None, redis_url=server.url, model="minilm", metrics_port=0,
                                 max_batch_size=batch_size, device=str(device),
                                 instances=instances)
        worker = assemble_worker(settings, model, Executor(model, device),
                                 connect(server.url, 1000))
        seconds, envelopes = serve_and_time(worker, server.url, "minilm", texts)
    assert len(envelopes) == len(texts) and all(e["ok"] for e in envelopes), "replies missing"
    return len(texts) / seconds


def check_throughput(model: Model, device: torch.device, repeat: int = 50) -> None:
    texts = SENTENCES.read_text().splitlines() * repeat
    offline = offline_throughput(model, device, texts, 64)
    say(f"offline loop, batches of 64:   {offline:9.0f} texts/s ({len(texts)} texts)")
    for instances in (1, 2):
        try:
            served = worker_throughput(model, device, texts, 64, instances)
        except Exception as exc:  # e.g. no redis-server binary on this machine
            say(f"through the worker: not measured ({type(exc).__name__}: {exc})")
            return
        say(f"through the worker and Redis, {instances} instance(s): {served:9.0f} texts/s "
            f"({served / offline:.0%} of offline)")


def check_generative(device: torch.device, dtype: str, out: Path, concurrency: int = 64,
                     prompts: int = 128) -> None:
    """One concurrency a call, each with its own report folder: a stage cut at its time
    limit still leaves the reports of the calls before it."""
    from bench.generative.run import main as generative

    generative(["--device", str(device), "--dtype", dtype, "--concurrency", str(concurrency),
                "--prompts", str(prompts), "--repeats", "1", "--kv-cache-mib", "4096",
                "--out", str(out / f"c{concurrency}")])


def check_generative_16(device: torch.device, dtype: str, out: Path) -> None:
    # 32 prompts, two waves: the baselines are launch-bound at 16 rows (on the first H200 run
    # transformers' generate_batch made 62 tokens/s there), and 128 would take minutes
    check_generative(device, dtype, out, concurrency=16, prompts=32)


def check_exactness(device: torch.device, dtype: str, out: Path) -> None:
    from bench.generative.exactness import main as exactness

    # the device's dtype only (float32's >= 99 % is checked on a CPU, where it takes minutes)
    exactness(["--device", str(device), "--dtype", dtype, "--prompts", "16", "--out", str(out)])


MinilmCheck = Callable[[Model, torch.device], object]
MINILM_CHECKS: dict[str, MinilmCheck] = {
    "overlap": check_overlap, "governor": check_governor, "oom-split": check_oom_split,
    "throughput": check_throughput, "vs-sentence-transformers": compare}
GENERATIVE_CHECKS: dict[str, Callable[[torch.device, str, Path], None]] = {
    "generative": check_generative, "generative-16": check_generative_16,
    "exactness": check_exactness}


def run_checks(args: argparse.Namespace, device: torch.device, dtype: str) -> int:
    """Each chosen check in turn, timed; a failure is reported and the next one runs."""
    model = None
    failed = 0
    for name in args.checks:
        say(f"\n== {name}")
        started = time.perf_counter()
        try:
            if name in GENERATIVE_CHECKS:
                GENERATIVE_CHECKS[name](device, dtype, args.out)
            else:
                if model is None:  # MiniLM, loaded once for its checks
                    model = create_model("minilm", {})
                    model.dtype = getattr(torch, dtype)
                    model.load(device)
                MINILM_CHECKS[name](model, device)
        except Exception as exc:
            failed += 1
            say(f"FAILED: {type(exc).__name__}: {exc}")
        say(f"({time.perf_counter() - started:.1f} s)")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    every = [*MINILM_CHECKS, *GENERATIVE_CHECKS]
    parser.add_argument("--checks", nargs="+", choices=every, default=every)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "gpu_check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        say("gpu_check: no CUDA device on this machine; nothing to check (exit 0)")
        return 0
    from worker.observe.log import configure_logging

    configure_logging("info")  # start-up lines (graphs captured), not each batch's
    begun = time.perf_counter()
    device = torch.device(args.device)
    precision = device_precision(args.dtype, device)
    say(f"gpu_check on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"dtype {precision.describe()} ({precision.reason})")
    failed = run_checks(args, device, precision.dtype)
    say(f"\ngpu_check: {failed} check(s) failed, {time.perf_counter() - begun:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
