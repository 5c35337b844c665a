"""gpu_compare's redbatch figure: the worker as its own process, the bench only its producer.

`python -m worker run --model minilm --device <device>` at default settings (bench/common/
processes.py `Workers`), on an embedded Redis without AOF (the worker is measured, not the
disk). This process only submits (one pipelined `submit_many` per round) and collects (a
second client, on its own thread, so replies are decoded while later requests are still
being sent, as a producer that waits for its results does): the producer's msgpack, XADDs
and decoding no longer share the worker's GIL, as they did when the worker ran in a thread
of this process. Each round sends the corpus `repeat` times on a fresh reply key; the
median round is the figure. The worker's start-up lines (its JSON log) say what it
resolved: dtype, instances, CUDA graphs captured; its /metrics how many batches replayed one.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common.processes import Workers
from producer import Client
from worker.streams.server import RedisServer

NAMESPACE = "bench-gpu"
START_TIMEOUT_S = 300.0  # import, load, capture every CUDA graph, warm up
ROUND_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Served:
    texts_per_s: float  # the median round's
    rounds: list[float]  # texts/s of each round
    submit_per_s: float  # the producer alone: requests sent per second (median round)
    requests: int  # per round
    startup: dict[str, dict[str, Any]] = field(default_factory=dict)  # log events by name
    graph_batches: dict[str, float] = field(default_factory=dict)  # replayed / eager

    def describe(self) -> str:
        serving = self.startup.get("worker.serving", {})
        return (f"dtype {serving.get('dtype', '?')}, {serving.get('instances', '?')} "
                f"instance(s), {self.requests} requests a round, rounds "
                + ", ".join(f"{rate:.0f}" for rate in self.rounds))

    def graphs(self) -> str:
        return graphs_line(self.startup, self.graph_batches)


def startup_events(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The worker's JSON log events by name (the last of each), other lines skipped."""
    events: dict[str, dict[str, Any]] = {}
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events[event["event"]] = event
    return events


def graphs_line(events: Mapping[str, Mapping[str, Any]], batches: Mapping[str, float]) -> str:
    """What the CUDA graphs did, from the start-up log and the replay counter (if any)."""
    captured = events.get("cuda_graphs.captured")
    if captured is None:
        skipped = events.get("cuda_graphs.skipped") or events.get("cuda_graphs.failed")
        why = (skipped or {}).get("reason") or (skipped or {}).get("error") or "none captured"
        return f"not used ({why})"
    line = f"used: {captured.get('shapes')} shapes captured in {captured.get('seconds')} s"
    if batches:
        line += (f", {batches.get('replayed', 0):.0f} batches replayed, "
                 f"{batches.get('eager', 0):.0f} eager")
    return line


def graph_batches(workers: Workers) -> dict[str, float]:
    """redbatch_cuda_graph_batches_total by `how`, summed over the processes ({}: none)."""
    found: dict[str, float] = {}
    for (name, labels), value in workers.metrics().items():
        if name == "redbatch_cuda_graph_batches_total":
            how = dict(labels).get("how", "?")
            found[how] = found.get(how, 0.0) + value
    return found


def one_round(url: str, model_name: str, texts: Sequence[str]) -> tuple[float, float]:
    """Submit every text (one pipelined submit_many) while a second client collects the
    replies; (texts/s until the last reply, requests/s of the submission alone)."""
    sender = Client(url, model_name, namespace=NAMESPACE)
    collector = Client(url, model_name, namespace=NAMESPACE)
    reply_to = sender.new_reply_key()
    envelopes: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: envelopes.extend(
        collector.collect(reply_to, len(texts), timeout=ROUND_TIMEOUT_S)), daemon=True)
    thread.start()
    started = time.perf_counter()
    sender.submit_many(({"text": text} for text in texts), reply_to=reply_to)
    submitted = time.perf_counter() - started
    thread.join(ROUND_TIMEOUT_S + 10)
    seconds = time.perf_counter() - started
    sender.close()
    collector.close()
    failed = [e for e in envelopes if not e["ok"]]
    if len(envelopes) != len(texts) or failed:
        raise RuntimeError(f"{len(envelopes)} of {len(texts)} replies, {len(failed)} failed"
                           + (f", e.g. {failed[0]['error']}" if failed else ""))
    return len(texts) / seconds, len(texts) / submitted


def redbatch_served(device: torch.device, texts: Sequence[str], rounds: int = 3,
                    repeat: int = 4, processes: int = 1, **settings: Any) -> Served:
    """The worker process at default settings (`settings`: any to change, e.g. for a test),
    or `processes` of them sharing the device: one warm request, then `rounds` rounds of
    `texts` x `repeat`."""
    sent = list(texts) * repeat
    found: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp), appendonly=False) as server:
        with Workers(server.url, NAMESPACE, processes, Path(tmp), model="minilm",
                     device=str(device), log_level="info", **settings) as workers:
            workers.wait_until_reading(START_TIMEOUT_S)
            warm = Client(server.url, workers.model_name, namespace=NAMESPACE)
            warm.infer({"text": "warm"}, timeout=120)
            warm.close()
            for _ in range(rounds):
                found.append(one_round(server.url, workers.model_name, sent))
            batches = graph_batches(workers)
        log = workers.log_path(0).read_text(errors="replace").splitlines()
    rates = [rate for rate, _ in found]
    median = statistics.median(rates)
    submit = statistics.median(per_s for _, per_s in found)
    return Served(median, rates, submit, len(sent), startup_events(log), batches)
