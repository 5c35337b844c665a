"""The six measurements, each taken side by side (repeats interleaved) in one run."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import structlog
import torch

from bench.common.load import Drained, Timed, drain, open_loop, redis_floor
from bench.common.machine import usable_cpus
from bench.common.processes import Workers
from bench.common.stats import Samples, histogram, median, percentiles
from bench.throughput.plan import Plan
from producer import protocol
from worker.commands.run import freeze_heap
from worker.execution.executor import Executor, device_precision, resolve_device
from worker.model_loading import set_precision
from worker.models import Model, Prepared, create_model

log = structlog.get_logger("redbatch.bench")


@dataclass(frozen=True)
class Layout:
    """How a process spends its cores: model instances, each with torch threads."""

    instances: int
    threads: int

    def __str__(self) -> str:
        return f"{self.instances} instance(s) x {self.threads} thread(s)"


def layouts(cores: int) -> list[Layout]:
    """One instance with one or every core, and as many single-threaded instances as cores."""
    return sorted({Layout(1, 1), Layout(1, cores), Layout(cores, 1)},
                  key=lambda layout: (layout.instances, layout.threads))


def offline_rate(model: Model, texts: Sequence[str], batch_size: int, layout: Layout) -> float:
    """The same model in-process, no Redis: tokenise, sort by length, run fixed-size
    batches, longest first (what sentence-transformers' `encode` does). Several instances
    take the batches in that order, each on its own thread (as Triton's instance groups, or
    sentence-transformers' multi-process pool, without the processes)."""
    started = time.perf_counter()
    run_batches(model, [model.prepare({"text": text}, len(text.encode())) for text in texts],
                batch_size, layout)
    return len(texts) / (time.perf_counter() - started)


def run_batches(model: Model, items: list[Prepared], batch_size: int, layout: Layout) -> None:
    """offline_rate's compute: prepared items sorted longest first, over the instances."""
    torch.set_num_threads(layout.threads)
    device = resolve_device("cpu")
    own = threading.local()  # each instance's thread runs its own executor

    def run(batch: list[Prepared]) -> None:
        if not hasattr(own, "executor"):
            own.executor = Executor(model, device)
        own.executor.run(batch)

    items = sorted(items, key=lambda item: item.length, reverse=True)
    with ThreadPoolExecutor(layout.instances) as instances:  # torch's thread count is global
        list(instances.map(run, [items[start:start + batch_size]
                                 for start in range(0, len(items), batch_size)]))


def batches_of(envelopes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One meta per batch: replies of a batch share worker, size and compute time."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for envelope in envelopes:
        meta = envelope["meta"]
        key = (meta["worker"], meta["batch_size"], meta["compute_ms"], meta["padded_length"])
        seen.setdefault(key, meta)
    return list(seen.values())


def check_ok(envelopes: Sequence[dict[str, Any]]) -> None:
    failed = [e for e in envelopes if not e["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")


class Benchmark:
    """Holds the Redis, the corpus and the model; each method returns one report section."""

    def __init__(self, plan: Plan, redis_url: str, texts: Sequence[str], model: str,
                 model_options: dict[str, Any], log_dir: Path) -> None:
        self.plan, self.log_dir, self.redis_url = plan, log_dir, redis_url
        self.client = redis.Redis.from_url(redis_url)
        self.texts = list(texts)
        self.payloads = [protocol.encode({"text": t}, protocol.MSGPACK) for t in self.texts]
        self.model_settings = {"model": model, "model_options": model_options}
        self.model = create_model(model, model_options)
        cpu = resolve_device("cpu")  # in the dtype a default worker picks (auto), as they run
        set_precision(self.model, device_precision("auto", cpu, self.model.generative))
        self.model.load(cpu)
        freeze_heap()  # as the workers do: the offline limit must not pay for collections they skip

    # --- (1)-(3): the corpus at saturation ---------------------------------------------------

    def lengths(self) -> list[int]:
        return [self.model.prepare({"text": t}, len(p)).length
                for t, p in zip(self.texts, self.payloads, strict=True)]

    def best_offline(self) -> dict[str, Any]:
        """The fastest batch size and layout (instances x torch threads) in-process, on part
        of the corpus."""
        texts = self.texts[:self.plan.selection_texts]
        rates = {(size, layout): offline_rate(self.model, texts, size, layout)
                 for size in self.plan.batch_sizes for layout in layouts(usable_cpus())}
        size, layout = max(rates, key=lambda config: rates[config])
        log.info("bench.offline_configs", best=(size, str(layout)),
                 rates={f"{b}, {lay}": round(r, 1) for (b, lay), r in rates.items()})
        return {"rates": {f"batch {b}, {lay}": r for (b, lay), r in rates.items()},
                "batch_size": size, "instances": layout.instances,
                "torch_threads": layout.threads, "texts": len(texts)}

    def pool_settings(self, batch_size: int,
                      layout: Layout) -> dict[str, tuple[int, dict[str, Any]]]:
        """Every worker pool of the run: process count and settings, by name."""
        corpus = {**self.model_settings, "max_batch_size": batch_size, "max_wait_ms": 5.0,
                  "instances": layout.instances,  # the offline limit's best: same footing
                  "torch_threads": layout.threads}
        # No compute to wait for: big reads and batches spread the per-call costs thin.
        echo = {"model": "echo", "model_options": {}, "max_batch_size": 512, "read_count": 1024,
                "max_inflight": 4096, "max_batch_tokens": 1 << 20}  # echo's tokens cost nothing
        delay = {"model": "echo", "model_options": {"delay_ms": self.plan.delay_ms},
                 "max_batch_size": 32, "read_count": 32, "max_inflight": 96}
        return {
            "redbatch": (1, corpus),
            "fifo": (1, {**corpus, "bucket_boundaries": []}),
            "batch1": (1, {**corpus, "max_batch_size": 1}),
            "defaults": (1, dict(self.model_settings)),  # what a user gets: instances auto
            "overhead": (1, echo),
            **{f"scale{n}": (n, delay) for n in self.plan.scaling_processes},
        }

    def start_workers(self, stack: ExitStack, batch_size: int,
                      layout: Layout) -> dict[str, Workers]:
        """Start every pool at once, wait until all read, and warm each one up."""
        pools = {name: stack.enter_context(Workers(self.redis_url, f"bench-{name}", count,
                                                   self.log_dir, **settings))
                 for name, (count, settings) in self.pool_settings(batch_size, layout).items()}
        for pool in pools.values():
            pool.wait_until_reading()
            self.warm_up(pool)
        return pools

    def saturation(self, pools: dict[str, Workers], batch_size: int,
                   layout: Layout) -> dict[str, Any]:
        """Offline vs redbatch (buckets), FIFO (no buckets), batch size 1 and the default
        settings, interleaved."""
        names = ("redbatch", "fifo", "batch1", "defaults")
        offline: list[float] = []
        runs: dict[str, list[Drained]] = {name: [] for name in names}
        before = {name: pools[name].metrics() for name in names}
        for repeat in range(self.plan.repeats):
            offline.append(offline_rate(self.model, self.texts, batch_size, layout))
            for name in names:
                runs[name].append(drain(self.client, pools[name].stream, self.payloads))
                check_ok(runs[name][-1].envelopes)
            log.info("bench.saturation", repeat=repeat, offline=round(offline[-1]),
                     **{n: round(r[-1].rate) for n, r in runs.items()})
        after = {name: pools[name].metrics() for name in names}
        section: dict[str, Any] = {"offline": {
            "batch_size": batch_size, "instances": layout.instances,
            "torch_threads": layout.threads, "rates": offline, "median": median(offline)}}
        for name, drained in runs.items():
            rates = [d.rate for d in drained]
            section[name] = {
                "settings": pools[name].settings,
                "rates": rates, "median": median(rates),
                # ratios per repeat, each against the offline figure taken beside it
                "ratio_to_offline": median([r / o for r, o in zip(rates, offline, strict=True)]),
                **self.batch_stats(before[name], after[name]),
            }
        section["redbatch"]["merge_tokens"] = next(
            (v for (metric, _), v in after["redbatch"].items()
             if metric == "redbatch_merge_tokens"), None)
        for name in ("fifo", "batch1"):
            section[name]["bucketing_speedup"] = median(
                [b.rate / o.rate for b, o in zip(runs["redbatch"], runs[name], strict=True)])
        section["defaults"]["ratio_to_best_layout"] = median(
            [d.rate / b.rate for d, b in zip(runs["defaults"], runs["redbatch"], strict=True)])
        return section

    @staticmethod
    def batch_stats(before: Samples, after: Samples) -> dict[str, Any]:
        real = sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k[0] == "redbatch_real_tokens_total")
        padded = sum(v - before.get(k, 0.0) for k, v in after.items()
                     if k[0] == "redbatch_padded_tokens_total")
        return {
            "batch_size_histogram": histogram(before, after, "redbatch_batch_size"),
            "padding_efficiency_histogram": histogram(before, after,
                                                      "redbatch_padding_efficiency"),
            "padding_efficiency": real / padded if padded else 1.0,
        }

    # --- (4): latency under open-loop Poisson arrivals ---------------------------------------

    def latency(self, pool: Workers, saturated_rate: float) -> dict[str, Any]:
        levels = []
        for index, load in enumerate(self.plan.loads):
            timed = open_loop(self.redis_url, pool.stream, self.payloads, load * saturated_rate,
                              self.plan.latency_s, seed=index)
            levels.append(self.latency_level(load, load * saturated_rate, timed,
                                             self.plan.latency_s,
                                             int(pool.settings.get("instances", 1))))
            log.info("bench.latency", load=load, e2e_ms=levels[-1]["e2e_ms"])
        return {"settings": pool.settings, "seconds_per_level": self.plan.latency_s,
                "levels": levels}

    @staticmethod
    def latency_level(load: float, rate: float, timed: Sequence[Timed], seconds: float,
                      instances: int = 1) -> dict[str, Any]:
        envelopes = [t.envelope for t in timed]
        check_ok(envelopes)
        batches = batches_of(envelopes)
        return {
            "load": load, "rate": rate, "requests": len(timed),
            # the share of the time the model instances were computing: small batches cost
            # more per request
            "busy": sum(b["compute_ms"] for b in batches) / 1000 / seconds / instances,
            "mean_batch_size": len(envelopes) / len(batches) if batches else 0.0,
            "e2e_ms": percentiles([t.latency_s * 1000 for t in timed]),
            "queue_ms": percentiles([e["meta"]["queue_ms"] for e in envelopes]),
            "batch_compute_ms": percentiles([b["compute_ms"] for b in batches]),
            "batch_size": percentiles([b["batch_size"] for b in batches]),
        }

    # --- (5): per-request overhead against Redis's own rate ----------------------------------

    def overhead(self, pool: Workers) -> dict[str, Any]:
        count = self.plan.echo_requests
        payloads = [self.payloads[i % len(self.payloads)] for i in range(count)]
        reply = protocol.encode(protocol.success_envelope(
            "r0", {"text": self.texts[0]}, {  # as big as the worker's own replies
                "model": "echo", "batch_size": 512, "compute_ms": 1.234, "worker": "host-1-abcd",
                "bucket": 1, "padded_length": 130, "queue_ms": 12.345}), protocol.MSGPACK)
        worker_rates: list[float] = []
        floors = []
        for repeat in range(self.plan.overhead_repeats):
            floors.append(redis_floor(self.client, f"{pool.stream}:floor", payloads, reply,
                                      read_count=pool.settings.get("read_count", 256)))
            drained = drain(self.client, pool.stream, payloads)
            check_ok(drained.envelopes)
            worker_rates.append(drained.rate)
            log.info("bench.overhead", repeat=repeat, worker=round(worker_rates[-1]),
                     redis=round(floors[-1].serve_rate))
        return {
            "settings": {**pool.settings, "processes": 1},
            "requests": count, "worker_rates": worker_rates, "worker_median": median(worker_rates),
            "redis_serve_rates": [f.serve_rate for f in floors],
            "redis_serve_median": median([f.serve_rate for f in floors]),
            "redis_xadd_median": median([f.xadd_rate for f in floors]),
            "redis_server_us_per_request": median([f.server_us_per_request for f in floors]),
            "ratio": median([w / f.serve_rate for w, f in zip(worker_rates, floors, strict=True)]),
        }

    # --- (6): scaling out worker processes ---------------------------------------------------

    def scaling(self, pools: dict[str, Workers]) -> dict[str, Any]:
        counts = self.plan.scaling_processes
        rates: dict[int, list[float]] = {n: [] for n in counts}
        for repeat in range(self.plan.repeats):
            for n in counts:
                count = self.plan.scaling_requests * n
                payloads = [self.payloads[i % len(self.payloads)] for i in range(count)]
                drained = drain(self.client, pools[f"scale{n}"].stream, payloads)
                check_ok(drained.envelopes)
                rates[n].append(drained.rate)
            log.info("bench.scaling", repeat=repeat, **{f"p{n}": round(r[-1])
                                                        for n, r in rates.items()})
        base = rates[counts[0]]
        return {
            "settings": pools[f"scale{counts[0]}"].settings,
            "processes": {n: {"rates": r, "median": median(r),
                              "factor": median([x / b for x, b in zip(r, base, strict=True)])}
                          for n, r in rates.items()},
        }

    # --- helpers ------------------------------------------------------------------------------

    def warm_up(self, pool: Workers) -> None:
        """A first pass through every process, so timing starts on warm code and caches."""
        count = self.plan.warmup * len(pool.processes)
        drained = drain(self.client, pool.stream,
                        [self.payloads[i % len(self.payloads)] for i in range(count)])
        check_ok(drained.envelopes)
