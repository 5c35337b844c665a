"""redbatch's figures: default settings end to end, its offline limit, its forward-only ceiling.

served   an embedded Redis (no AOF) and one `python -m worker run --model minilm` process at
         default settings (bench/common/processes.py); this process only its producer: every
         text in one pipelined `Client.submit_many` while a second client collects the replies
         (bench/throughput/gpu_served.py one_round), texts/s from the first submit to the last
         reply. The worker's `worker.serving` log line says the dtype and layout it chose.
offline  the model loaded as a default worker loads it (same dtype, gpu_offline.offline_setup)
         called in-process, no Redis: texts sorted by length, fixed-size batches, over one or
         several instances (bench/throughput/measure.py offline_rate); or the worker's own
         batch limits with its batched tokeniser on one instance of every core
         (gpu_offline.end_to_end); the fastest configuration is its limit, the goal's bar.
forward  the same loop on texts tokenised beforehand: the model's compute alone, a ceiling
only     reported for reference (a worker tokenises every text it serves).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy
import torch

from bench.common.processes import Workers
from bench.peers.systems import System
from bench.throughput.gpu_offline import end_to_end, offline_setup
from bench.throughput.gpu_served import NAMESPACE, START_TIMEOUT_S, one_round, startup_events
from bench.throughput.measure import Layout, layouts, offline_rate, run_batches
from worker.models import Model
from worker.streams.server import RedisServer


def start_worker(stack: ExitStack, folder: Path) -> Workers:
    """A Redis and one default worker process, started (not yet waited for)."""
    server = stack.enter_context(RedisServer(folder, appendonly=False))
    return stack.enter_context(Workers(server.url, NAMESPACE, 1, folder, model="minilm",
                                       log_level="info"))


def serving_line(workers: Workers, timeout_s: float = 30.0) -> dict[str, Any]:
    """The worker's `worker.serving` log event ({} if none in time): its reader may join the
    group a moment before that line is written."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = workers.log_path(0).read_text(errors="replace").splitlines()
        serving = startup_events(log).get("worker.serving")
        if serving is not None or time.monotonic() > deadline:
            return serving or {}
        time.sleep(0.1)


def served(workers: Workers) -> System:
    """The default worker, once it reads; its dtype from its start-up log."""
    workers.wait_until_reading(START_TIMEOUT_S)

    def encode(texts: Sequence[str]) -> float:
        return one_round(workers.redis_url, workers.model_name, texts)[0]

    serving = serving_line(workers)
    return System("redbatch", "redbatch", str(serving.get("dtype", "?")),
                  {"default settings": encode},
                  note=f"{serving.get('instances', '?')} instance(s) x "
                       f"{serving.get('threads', '?')} thread(s); {serving.get('dtype_why', '')}")


def offline(batch_sizes: Sequence[int], cores: int) -> list[System]:
    """The offline limit (tokenising inside the clock, as a served text is tokenised: the
    goal's) and its forward-only ceiling (tokenised beforehand), every batch size with every
    layout."""
    setup = offline_setup(torch.device("cpu"))

    def config(size: int, layout: Layout) -> Any:
        return lambda texts: offline_rate(setup.model, texts, size, layout)

    def limits(texts: Sequence[str]) -> float:
        torch.set_num_threads(cores)  # torch's threads are process-wide: the layouts set them
        return end_to_end(setup, texts, repeats=1)

    configs = {f"batch {size}, {layout}": config(size, layout)
               for size in batch_sizes for layout in layouts(cores)}
    configs[f"worker's batch limits {setup.limits[0]} rows / {setup.limits[1]} tokens, "
            f"1 instance(s) x {cores} thread(s)"] = limits
    return [System("redbatch offline", "redbatch", setup.dtype, configs,
                   note="the worker's model and executor in-process, no Redis",
                   embed=lambda texts: embeddings(setup.model, texts)),
            forward_only(setup.model, setup.dtype, batch_sizes, cores)]


def embeddings(model: Model, texts: Sequence[str], size: int = 32) -> numpy.ndarray:
    """The model's normalised rows for `texts`, in its dtype as a worker serves them: the
    accuracy redbatch's figures are compared at."""
    rows = []
    with torch.inference_mode():
        for start in range(0, len(texts), size):
            items = [model.prepare({"text": t}, len(t.encode()))
                     for t in texts[start:start + size]]
            rows.append(torch.as_tensor(model.forward(model.collate(items))).float())
    return torch.nn.functional.normalize(torch.cat(rows), dim=1).numpy()


def forward_only(model: Model, dtype: str, batch_sizes: Sequence[int], cores: int) -> System:
    """The same loop with the texts tokenised outside the clock: compute alone."""
    def config(size: int, layout: Layout) -> Any:
        def encode(texts: Sequence[str]) -> float:
            items = [model.prepare({"text": text}, len(text.encode())) for text in texts]
            started = time.perf_counter()
            run_batches(model, items, size, layout)
            return len(texts) / (time.perf_counter() - started)
        return encode

    return System("redbatch forward only", "redbatch", dtype,
                  {f"batch {size}, {layout}": config(size, layout)
                   for size in batch_sizes for layout in layouts(cores)},
                  note="tokenised beforehand: the model's ceiling, for reference")
