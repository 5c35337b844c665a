"""`python -m bench.throughput.host_path`: the worker's host path, without the model's compute.

One run, one embedded Redis, one in-process worker at a time, the same payloads
(`examples/sentences.txt`, repeated: mixed lengths) for:

  echo      the echo model: read, decode, batch, reply; no tokeniser, no tensors
  instant   MiniLM with an instant forward (a zero tensor of the right shape): its tokeniser,
            collate, post-processing and 384-float replies, without the transformer
            and tokenising on the prepare thread, as a worker on an accelerator does
  inline    (--inline) the same, tokenising on the reader thread between its reads, as a
            worker on a CPU does (worker/pipeline/prepare_stage.py)

All variants batch as a CPU worker does (64 requests, the model's buckets); with
--gpu-batching, as a CUDA worker does by default (policy/device_defaults.py: up to 512
requests, buckets thinned to 1.5x steps), the layout an instant forward stands in for.

Each round submits every payload (one pipelined XADD per request, one shared reply list)
and times until the last reply is there; the variants take turns, round by round (a first,
uncounted round warms each), and the median rate is reported with instant / echo. Then one
instrumented pass per variant attributes the worker's CPU time (per-thread CPU clocks around
each stage) in µs per request. The ceiling of a fast device is this host path: see issue 31.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis
import torch

from bench.common.paths import SENTENCES
from bench.throughput.stage_clock import STAGES, StageClock
from producer import protocol, request_entry
from worker.execution.executor import Executor, device_precision, resolve_device
from worker.models import Model, create_model
from worker.models.echo import EchoModel
from worker.models.minilm import MiniLMModel
from worker.pipeline.prepare_stage import PrepareStage
from worker.policy.device_defaults import CUDA_BATCH_DEFAULTS, default_boundaries


class InstantMiniLM(MiniLMModel):
    """MiniLM's host path (tokenise, collate, post-process) around an instant forward."""

    def __init__(self, **options: Any) -> None:
        super().__init__(trace=False, **options)

    def forward(self, batch: Any) -> torch.Tensor:
        ids = batch["input_ids"]  # what pooling would return, where it would return it
        return torch.full((ids.shape[0], 384), 0.05, dtype=torch.float32, device=ids.device)


def payloads(count: int, encoding: str | None) -> list[bytes]:
    texts = SENTENCES.read_text().splitlines()
    chosen = [texts[i % len(texts)] for i in range(count)]
    extra = {"encoding": encoding} if encoding else {}
    return [protocol.encode({"text": text, **extra}, protocol.MSGPACK) for text in chosen]


@dataclass(frozen=True, slots=True)
class Layout:
    instances: int = 1
    gpu_batching: bool = False  # a CUDA worker's default batch limits and buckets

    def settings(self, model: Model) -> dict[str, Any]:
        """64-request batches and the model's own buckets, as on a CPU; with gpu_batching,
        what a CUDA worker resolves to by default (policy/device_defaults.py): batches of
        up to 512 requests, buckets thinned to 1.5x steps (fewer, fuller batches)."""
        if not self.gpu_batching:
            return {"instances": self.instances, "max_batch_size": 64}
        return {"instances": self.instances, **CUDA_BATCH_DEFAULTS,
                "bucket_boundaries": default_boundaries(model.default_bucket_boundaries,
                                                        "cuda")}


@contextmanager
def serving(url: str, name: str, model: Model, layout: Layout) -> Iterator[None]:
    """A worker for `model` on stream `name`, in a thread, until the block ends (`inline`:
    without the prepare stage's thread)."""
    from worker.app import assemble_worker, connect
    from worker.settings import load_settings

    settings = load_settings(None, redis_url=url, model="echo", model_name=name,
                             metrics_port=0, block_ms=100, warmup=False,
                             **layout.settings(model))
    worker = assemble_worker(settings, model, Executor(model, model.device),
                             connect(url, 100))
    # `instant` as on an accelerator (the worker does so off the CPU); `inline` as on a CPU
    worker.intake.stage = PrepareStage(threaded=name != "inline")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(30), "worker did not start"
    try:
        yield
    finally:
        worker.stop()
        thread.join(timeout=30)


def one_round(client: redis.Redis, name: str, data: Sequence[bytes]) -> float:
    """Submit every payload, wait for every reply: texts per second."""
    reply_to = f"redbatch:reply:bench-host:{name}:{time.monotonic_ns()}"
    stream = protocol.stream_key(protocol.DEFAULT_NAMESPACE, name)
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for n, payload in enumerate(data):
        fields: Any = request_entry.entry_fields(f"{reply_to}:{n}", payload, reply_to=reply_to)
        pipe.xadd(stream, fields)
    pipe.execute()
    deadline = started + 120
    while client.llen(reply_to) < len(data):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{name}: {client.llen(reply_to)} of {len(data)} replies")
        time.sleep(0.002)
    seconds = time.perf_counter() - started
    replies = cast(list[bytes], client.lrange(reply_to, 0, 5))  # no decode_responses
    client.delete(reply_to)
    bad = [e for e in map(protocol.decode_envelope, replies) if not e["ok"]]
    if bad:
        raise RuntimeError(f"{name}: failed replies, e.g. {bad[0]}")
    return len(data) / seconds


def rates(url: str, models: dict[str, Model], data: Mapping[str, Sequence[bytes]], rounds: int,
          layout: Layout) -> dict[str, list[float]]:
    """Texts/s of each model, round by round, the variants taking turns. Each variant's
    first round is not counted: in a fresh process it ran at 0.5-0.6x the later rounds
    (allocator, Redis and the tokenizer's caches growing), which 3 rounds could not outvote."""
    client = redis.Redis.from_url(url)
    found: dict[str, list[float]] = {name: [] for name in models}
    for counted in [False] + [True] * rounds:
        for name, model in models.items():
            with serving(url, name, model, layout):
                one_round(client, name, data[name][:64])  # warm: first batches of each shape
                rate = one_round(client, name, data[name])
            if counted:
                found[name].append(rate)
    return found


def stage_costs(url: str, name: str, model: Model, data: Sequence[bytes],
                layout: Layout) -> dict[str, float]:
    """CPU µs per request per stage, in one instrumented round."""
    client = redis.Redis.from_url(url)
    with serving(url, name, model, layout):
        one_round(client, name, data[:64])
        with StageClock(model) as clock:
            one_round(client, name, data)
    return clock.per_request_us(len(data))


def report(found: dict[str, list[float]], costs: dict[str, dict[str, float]],
           say: Callable[[str], None]) -> None:
    medians = {name: statistics.median(values) for name, values in found.items()}
    for name, values in found.items():
        say(f"{name:>8}: median {medians[name]:8.0f} texts/s  "
            f"(rounds: {', '.join(f'{v:.0f}' for v in values)})")
    for name in ("instant", "inline"):
        if {"echo", name} <= medians.keys():
            say(f"{name} / echo = {medians[name] / medians['echo']:.2f}")
    if not costs:
        return
    names = list(costs)
    say("\nCPU µs per request " + "".join(f"{n:>10}" for n in names))
    for stage in (*STAGES, "sum", "native", "process"):
        say(f"{stage:<18} " + "".join(f"{costs[n].get(stage, 0.0):10.1f}" for n in names))


def loaded_models(args: argparse.Namespace) -> dict[str, Model]:
    """echo, the instant forward, and with --inline / --real its variants, loaded once each."""
    models: dict[str, Model] = {"echo": create_model("echo", {}), "instant": InstantMiniLM()}
    if args.inline:
        models["inline"] = models["instant"]  # the same object: one tokenizer, one load
    if args.real:
        models["minilm"] = create_model("minilm", {})
    device = resolve_device(args.device)
    for model in {id(model): model for model in models.values()}.values():
        if model.__class__ is not EchoModel:
            model.dtype = getattr(torch, device_precision(args.dtype, device).dtype)
        model.load(device)
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput.host_path",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--encoding", default=None,
                        help="the payload's `encoding` option for MiniLM, e.g. float32")
    parser.add_argument("--no-stages", action="store_true", help="rates only")
    parser.add_argument("--gpu-batching", action="store_true",
                        help="every variant with a CUDA worker's default batch limits and "
                             "buckets (the layout the instant forward stands in for)")
    parser.add_argument("--device", default="cpu", help="e.g. cuda: the same on a GPU")
    parser.add_argument("--dtype", default="auto", help="the dtype setting, for MiniLM")
    parser.add_argument("--inline", action="store_true",
                        help="also `inline`: the instant forward, tokenising on the reader thread")
    parser.add_argument("--real", action="store_true",
                        help="also MiniLM's real forward (`minilm`), for the device's share")
    args = parser.parse_args(argv)
    from worker.observe.log import configure_logging
    from worker.streams.server import RedisServer

    configure_logging("warning", "console")
    torch.set_num_threads(1)
    models = loaded_models(args)
    data = {name: payloads(args.requests, None if name == "echo" else args.encoding)
            for name in models}
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp), appendonly=False) as server:
        layout = Layout(args.instances, args.gpu_batching)
        found = rates(server.url, models, data, args.rounds, layout)
        costs = {} if args.no_stages else {
            name: stage_costs(server.url, name, model, data[name], layout)
            for name, model in models.items()}
    report(found, costs, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
