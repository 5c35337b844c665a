"""`python -m bench.generative.host_path`: the generate loop's host path, without the model.

SmolLM2 served as a worker serves it: the scheduler, the engine's staging (block tables,
slots, one upload a step), the choice of each row's token, incremental detokenisation, a
chunk XADD per token per request and the `done` entry, through one embedded Redis; only the
forward is instant (the logits of one fixed ordinary token, made in no time). Its tokens/s
is the ceiling of a device whose arithmetic were free: what a GPU that replays decode steps
as CUDA graphs leaves to the host (issue 32). On a CPU the argmax over the vocabulary, a
device's work, is still paid here, so the figure understates that ceiling.

Each round submits `--requests` streamed requests of `--tokens` tokens each at once (the
worker runs `--concurrency` of them together, `max_seqs`), and times until every `done`
entry is written (the model's answered counter); a first round warms, then the median of the
counted rounds is reported, with host milliseconds per decode step.

    python -m bench.generative.host_path [--requests 192] [--tokens 64] [--concurrency 64]
                                         [--device cuda]

On a GPU (`--device cuda`, bench/gpu_session.sh) the token choice runs there, as it does
when serving, and no CUDA graph is captured: every step's forward is the instant one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import redis
import torch

from producer import protocol
from producer.request_entry import entry_fields
from worker.execution.executor import device_precision, resolve_device
from worker.execution.generation import GenerationEngine
from worker.execution.paged_attention import Layout
from worker.models import create_model
from worker.models.generative import CausalLM

MODEL = "smollm2"
PROMPT = "Redis streams carry inference requests to GPU workers, which batch them by length"


def instant_forward(engine: GenerationEngine, rows: int) -> None:
    """Replace the engine's forward with the logits of one ordinary token for every row."""
    token = int(engine.tokenizer(" the", add_special_tokens=False).input_ids[0])
    logits = torch.zeros(rows, engine.lm.config.vocab_size, device=engine.device)
    logits[:, token] = 1.0

    def forward(ids: torch.Tensor, layout: Layout) -> torch.Tensor:
        return logits

    engine.logits = forward  # type: ignore[method-assign]


@contextmanager
def serving(url: str, model: CausalLM, concurrency: int) -> Iterator[GenerationEngine]:
    """A worker for the model on stream `MODEL`, in a thread, its forward instant."""
    from worker.app import assemble_worker, connect
    from worker.execution.executor import Executor
    from worker.pipeline.generate import GenerateLoop
    from worker.settings import load_settings

    settings = load_settings(None, redis_url=url, model=MODEL, metrics_port=0, block_ms=100,
                             warmup=False, max_inflight=4 * concurrency, cuda_graphs=False)
    worker = assemble_worker(settings, model, Executor(model, model.device),
                             connect(url, 100))
    loop = worker.computes[0]
    assert isinstance(loop, GenerateLoop)
    instant_forward(loop.engine, max(concurrency, 256))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(60), "worker did not start"
    try:
        yield loop.engine
    finally:
        worker.stop()
        thread.join(timeout=60)


def one_round(client: redis.Redis, requests: int, tokens: int) -> float:
    """Submit every request, wait for every `done` entry: generated tokens per second."""
    answered = protocol.answered_key(protocol.DEFAULT_NAMESPACE, MODEL)
    stream = protocol.stream_key(protocol.DEFAULT_NAMESPACE, MODEL)
    start = int(client.get(answered) or 0)
    payload = msgpack.packb({"prompt": PROMPT, "max_new_tokens": tokens, "stream": True})
    tag = time.monotonic_ns()
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for n in range(requests):
        pipe.xadd(stream, entry_fields(f"h{tag}-{n}", payload))  # type: ignore[arg-type]
    pipe.execute()
    deadline = started + 600
    while int(client.get(answered) or 0) < start + requests:
        if time.perf_counter() > deadline:
            raise RuntimeError("the generations did not finish within 600 s")
        time.sleep(0.002)
    rate = requests * tokens / (time.perf_counter() - started)
    check_answer(client, f"h{tag}-{requests - 1}", tokens)
    return rate


def check_answer(client: redis.Redis, request_id: str, tokens: int) -> None:
    """A request's reply stream ends in a successful `done` entry of `tokens` tokens."""
    key = protocol.token_stream_key(protocol.DEFAULT_NAMESPACE, request_id)
    entries: Any = client.xrange(key)
    done = protocol.decode_envelope(entries[-1][1][b"data"]) if entries else {}
    if done.get("type") != "done" or not done.get("ok") or \
            done["result"]["tokens"] != tokens or len(entries) != tokens + 1:
        raise RuntimeError(f"{request_id}: not {tokens} streamed tokens and a done entry: "
                           f"{len(entries)} entries, last {done}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generative.host_path",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker.observe.log import configure_logging
    from worker.streams.server import RedisServer

    configure_logging("warning", "console")
    model: Any = create_model(MODEL, {"max_seqs": args.concurrency,
                                      "max_new_tokens_limit": max(1024, args.tokens)})
    device = resolve_device(args.device)
    model.dtype = getattr(torch, device_precision("auto", device, generative=True).dtype)
    model.load(device)
    rates = []
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp), appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        with serving(server.url, model, args.concurrency):
            for counted in [False] + [True] * args.rounds:
                rate = one_round(client, args.requests, args.tokens)
                if counted:
                    rates.append(rate)
    median = statistics.median(rates)
    print(f"{MODEL} on {device}, instant forward, {args.requests} requests x {args.tokens} "
          f"tokens, {args.concurrency} at a time, streamed")
    print(f"tokens/s: median {median:.0f} (rounds: {', '.join(f'{r:.0f}' for r in rates)})")
    print(f"host ms per decode step of {args.concurrency} rows: "
          f"{args.concurrency / median * 1000:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
