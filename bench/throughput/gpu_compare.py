"""gpu_check's comparison: redbatch at default settings against sentence-transformers.

On one mixed-length corpus (bench/corpus.py: thousands of docstring paragraphs):
  redbatch   the worker as `python -m worker run` builds it (default settings: the device's
             dtype, batch limits, buckets, instances and CUDA graphs), through Redis
  offline    redbatch's own limit: the same loaded model and executors, in the same dtype,
             fed pre-tokenised batches sorted by length, the next staged while one computes
  ST         sentence-transformers' `encode`, batch 32, 128 and 512, in float32 and float16
and the goals of issue 31: redbatch >= 1.5x sentence-transformers' best, >= 0.8x offline.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common.corpus import build_corpus
from worker.execution.cuda_graphs import GraphedForward
from worker.execution.executor import Executor, Launched, dtype_name
from worker.models.base import Model, Prepared

CORPUS_TEXTS = 8000
ST_BATCH_SIZES = (32, 128, 512)
ST_GOAL, OFFLINE_GOAL = 1.5, 0.8  # redbatch's throughput over ST's best, and over offline
Say = Callable[[str], None]


def say_now(line: str) -> None:
    print(line, flush=True)


@dataclass(slots=True)
class Served:
    texts_per_s: float
    dtype: str
    graphs: str  # what the CUDA graphs did, for the report
    model: Model
    executors: list[Executor]
    limits: tuple[int, int]  # max_batch_size, max_batch_tokens as resolved on the device


def corpus_texts(count: int = CORPUS_TEXTS) -> list[str]:
    return build_corpus(count, seed=31).texts


def graphs_report(executors: Sequence[Executor]) -> str:
    graphed = executors[0].graphs
    if not isinstance(graphed, GraphedForward):
        return "not used (eager)"
    return (f"used: {len(graphed.shapes)} shapes captured, {graphed.replays} batches "
            f"replayed, {graphed.eager} eager")


def serve_and_time(worker: Any, url: str, model_name: str,
                   texts: list[str]) -> tuple[float, list[dict[str, Any]]]:
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


def redbatch_default(device: torch.device, texts: Sequence[str]) -> Served:
    """The worker at default settings, through an embedded Redis: submit all, await all."""
    from worker.app import build_worker, connect
    from worker.observe.log import configure_logging
    from worker.settings import load_settings
    from worker.streams.server import RedisServer

    configure_logging("info")  # the start-up lines (graphs captured), not each batch's
    with tempfile.TemporaryDirectory() as data, RedisServer(Path(data)) as server:
        settings = load_settings(None, redis_url=server.url, metrics_port=0,
                                 device=str(device))
        worker = build_worker(settings, connect(server.url, 1000))
        seconds, envelopes = serve_and_time(worker, server.url, settings.model_name, texts)
    if len(envelopes) != len(texts) or not all(e["ok"] for e in envelopes):
        raise RuntimeError(f"{len(envelopes)} of {len(texts)} replies, or some not ok")
    executors = [runner.executor for runner in worker.runners]
    resolved = worker.settings
    return Served(len(texts) / seconds, dtype_name(worker.model.dtype),
                  graphs_report(executors), worker.model, executors,
                  (resolved.max_batch_size, resolved.max_batch_tokens))


def length_sorted_batches(items: Sequence[Prepared], max_rows: int,
                          max_tokens: int) -> list[list[Prepared]]:
    """Items sorted by length, cut into batches under both limits (as ST sorts its input)."""
    batches: list[list[Prepared]] = [[]]
    for item in sorted(items, key=lambda i: i.length):
        batch = batches[-1]
        if batch and (len(batch) >= max_rows or (len(batch) + 1) * item.length > max_tokens):
            batches.append(batch := [])
        batch.append(item)
    return [batch for batch in batches if batch]


def offline_limit(served: Served, texts: Sequence[str], repeats: int = 2) -> float:
    """The served model and executor (its graphs too) in a loop with no queue: the best of
    `repeats` passes, tokenising outside the clock."""
    model, executor = served.model, served.executors[0]
    items = [p for p in model.prepare_many([({"text": t}, len(t)) for t in texts])
             if isinstance(p, Prepared)]
    batches = length_sorted_batches(items, *served.limits)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        running: Launched | None = None
        for batch in batches:
            staged = executor.stage(batch)
            if running is not None:
                executor.finish(running)
            running = executor.launch(staged)
        if running is not None:
            executor.finish(running)
        best = max(best, len(items) / (time.perf_counter() - started))
    return best


def st_throughputs(device: torch.device, texts: Sequence[str], say: Say
                   ) -> dict[tuple[str, int], float]:
    """sentence-transformers' encode of the bundled MiniLM: texts/s by (dtype, batch size)."""
    from sentence_transformers import SentenceTransformer  # the GPU image has it

    from worker.models.minilm import bundled_model_path

    results: dict[tuple[str, int], float] = {}
    for dtype in ("float32", "float16"):
        st = SentenceTransformer(str(bundled_model_path()), device=str(device))
        if dtype == "float16":
            st = st.half()
        st.encode(list(texts[:512]), batch_size=128, show_progress_bar=False)  # warm
        for batch_size in ST_BATCH_SIZES:
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            st.encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                      show_progress_bar=False)
            torch.cuda.synchronize(device)
            results[dtype, batch_size] = len(texts) / (time.perf_counter() - started)
            say(f"sentence-transformers {dtype}, batch {batch_size:>3}: "
                f"{results[dtype, batch_size]:9.0f} texts/s")
        del st
        torch.cuda.empty_cache()
    return results


def verdict(ratio: float, goal: float) -> str:
    return f"{ratio:.2f}x (goal >= {goal}x: {'met' if ratio >= goal else 'MISSED'})"


def compare(model: Model, device: torch.device, say: Say = say_now) -> None:
    """The comparison as one gpu_check step (`model`, gpu_check's own, is not used: the
    worker loads its own, at default settings)."""
    texts = corpus_texts()
    mean = sum(len(t) for t in texts) / len(texts)
    say(f"corpus: {len(texts)} texts, mean {mean:.0f} characters")
    served = redbatch_default(device, texts)
    say(f"redbatch, default settings, through Redis: {served.texts_per_s:9.0f} texts/s "
        f"(dtype {served.dtype}, batch limits {served.limits[0]} requests / "
        f"{served.limits[1]} tokens, {len(served.executors)} instance(s))")
    say(f"CUDA graphs: {served.graphs}")
    offline = offline_limit(served, texts)
    say(f"redbatch offline limit, {served.dtype}:          {offline:9.0f} texts/s")
    try:
        st = st_throughputs(device, texts, say)
    except ImportError as exc:
        say(f"sentence-transformers: not measured ({exc})")
        st = {}
    say(f"redbatch / offline limit: {verdict(served.texts_per_s / offline, OFFLINE_GOAL)}")
    if st:
        (dtype, batch), best = max(st.items(), key=lambda kv: kv[1])
        say(f"redbatch / sentence-transformers' best ({dtype}, batch {batch}, {best:.0f} "
            f"texts/s): {verdict(served.texts_per_s / best, ST_GOAL)}")
