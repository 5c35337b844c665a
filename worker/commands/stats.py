"""`python -m worker stats`: the queue of every model on one screen (rich), or JSON for scripts.

Throughput is the change of the replies counter between two readings (`--interval` apart,
or successive refreshes with `--watch`), so it covers every worker of the group.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from producer import local_redis
from producer.batches import keys as batch_keys
from producer.batches import objects as batch_objects
from producer.connection import ConnectionSettingsError, redacted, sync_client
from worker.settings import Settings
from worker.streams.queue_stats import (
    ConsumerStats,
    RateMeter,
    StreamStats,
    discover_models,
    drain_seconds,
    read_stream_stats,
)


class StatsReader:
    """Reads every model's stats and keeps a rate meter per model across readings."""

    def __init__(self, client: redis.Redis, namespace: str, group: str,
                 models: list[str] | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.group = group
        self.models = models
        self.meters: dict[str, RateMeter] = {}
        self.batches: list[dict[str, Any]] = []  # the batch jobs, as of the last reading

    def read(self) -> list[tuple[StreamStats, float | None]]:
        models = self.models or discover_models(self.client, self.namespace)
        now = time.monotonic()
        rows = []
        for model in models:
            stats = read_stream_stats(self.client, self.namespace, model, self.group)
            meter = self.meters.setdefault(model, RateMeter())
            meter.add(now, stats.answered)
            rows.append((stats, meter.rate()))
        self.batches = read_batches(self.client, self.namespace)
        return rows


TABLE_BOX = box.SIMPLE_HEAD  # no column rules, so that the tables fit 80 columns


def read_batches(client: redis.Redis, namespace: str) -> list[dict[str, Any]]:
    """The batch jobs not yet final: counts, lines/s since they started and the ETA."""
    ids: list[Any] = list(client.zrange(batch_keys.active_batches(namespace), 0, -1))
    pipe = client.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hgetall(batch_keys.BatchKeys(namespace, batch_id.decode()).meta)
    rows, now = [], time.time()
    for meta in pipe.execute() if ids else []:
        if not meta:
            continue
        found = batch_objects.batch_object(meta)
        per_s, eta = batch_objects.rate(meta, now)
        rows.append({"id": found["id"], "model": found["model"], "status": found["status"],
                     **found["request_counts"], "lines_per_s": per_s, "eta_seconds": eta})
    return rows


def batch_table(batches: list[dict[str, Any]]) -> Table:
    table = Table(title="batch jobs", title_justify="left", box=TABLE_BOX)
    table.add_column("batch", no_wrap=True)
    for column in ("model", "status", "done", "failed", "total", "lines/s", "eta"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in batches:
        eta = "—" if row["eta_seconds"] is None else format_duration(row["eta_seconds"])
        table.add_row(row["id"], row["model"] or "—", row["status"], str(row["completed"]),
                      str(row["failed"]), str(row["total"]), f"{row['lines_per_s']:.1f}", eta)
    return table



def format_duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "stalled"
    if 0 < seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe_state(consumer: ConsumerStats) -> str:
    """"live 3 s" or "dead 2 min" since the worker last announced itself; "dead" if never."""
    if consumer.seen_ms is None:
        return "dead"
    ago = max(0.0, time.time() - consumer.seen_ms / 1000)
    return f"{'live' if consumer.live else 'dead'} {format_duration(ago)}"


def describe_latency(latency: dict[str, float] | None) -> str:
    """"p99 182 of 250 ms, margin 10 ms, batch share 0.25" (the share of the time batch
    jobs' lines may take, which the target steers), or "—" without a target."""
    if not latency:
        return "—"
    name = f"p{latency['percentile'] * 100:g}"
    share = f", batch share {latency['batch_share']:.2g}" if "batch_share" in latency else ""
    return (f"{name} {latency['observed_ms']:.0f} of {latency['target_ms']:.0f} ms, "
            f"margin {latency['margin_ms']:.0f} ms{share}")


def render(rows: list[tuple[StreamStats, float | None]], group: str,
           batches: list[dict[str, Any]] | None = None) -> Group:
    models = Table(title=f"redbatch queues (group '{group}')", title_justify="left",
                   box=TABLE_BOX)
    models.add_column("model", no_wrap=True)
    for column in ("length", "lag", "pending", "backlog", "consumers", "dead", "req/s",
                   "drain"):
        models.add_column(column, justify="right", no_wrap=True, min_width=len(column))
    consumers = Table(title="consumers", title_justify="left", box=TABLE_BOX)
    consumers.add_column("model", no_wrap=True, min_width=6)
    consumers.add_column("consumer", overflow="fold", min_width=8)  # long texts wrap when
    consumers.add_column("pending", justify="right", no_wrap=True, min_width=7)  # narrow
    consumers.add_column("state", no_wrap=True, min_width=8)  # by announcement, not idle
    consumers.add_column("layout", min_width=14)
    consumers.add_column("latency target", min_width=14)
    for stats, rate in rows:
        lag = f"≥{stats.lag}" if stats.lag_capped else str(stats.lag)
        drain = "—" if rate is None else format_duration(drain_seconds(stats.backlog, rate))
        models.add_row(stats.model, str(stats.length), lag, str(stats.pending),
                       str(stats.backlog), str(len(stats.consumers)), str(stats.dead_letters),
                       "—" if rate is None else f"{rate:.1f}", drain)
        for consumer in stats.consumers:
            consumers.add_row(stats.model, consumer.name, str(consumer.pending),
                              describe_state(consumer),
                              ", ".join(filter(None, (consumer.layout, consumer.dtype))) or "—",
                              describe_latency(consumer.latency))
    if not rows:
        models.caption = "no request streams yet"
    tables = [models, consumers]
    if any(stats.shards for stats, _ in rows):
        tables.append(shard_table(rows))
    if batches:
        tables.append(batch_table(batches))
    return Group(*tables)


def shard_table(rows: list[tuple[StreamStats, float | None]]) -> Table:
    """On a Redis Cluster: each shard of each model, and the master that holds it."""
    table = Table(title="shards (Redis Cluster)", title_justify="left", box=TABLE_BOX)
    table.add_column("model", no_wrap=True)
    table.add_column("shard", justify="right")
    table.add_column("node", no_wrap=True)
    for column in ("length", "lag", "pending", "dead"):
        table.add_column(column, justify="right")
    for stats, _ in rows:
        for shard in stats.shards:
            table.add_row(stats.model, str(shard.shard), shard.node, str(shard.length),
                          str(shard.lag), str(shard.pending), str(shard.dead_letters))
    return table


def to_json(rows: list[tuple[StreamStats, float | None]],
            batches: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    def model(stats: StreamStats, rate: float | None) -> dict[str, Any]:
        drain = None if rate is None else drain_seconds(stats.backlog, rate)
        return {**stats.to_dict(), "throughput_per_s": rate,
                "drain_seconds": None if drain is None or math.isinf(drain) else drain}

    return {"time": time.time(), "models": [model(stats, rate) for stats, rate in rows],
            "batches": batches or []}


def run_stats(settings: Settings, models: list[str] | None, watch: float | None,
              as_json: bool, interval: float,
              console: Console | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """One screen (after two readings `interval` apart), or refresh every `watch` seconds."""
    console = console or Console()
    url = stats_url(settings)
    if not url:
        return 2
    try:
        client = sync_client(url, settings.redis_cluster, socket_timeout=10,
                             socket_connect_timeout=5, password=settings.redis_secret)
    except ConnectionSettingsError as exc:
        print(f"redbatch: {exc}", file=sys.stderr)
        return 2
    reader = StatsReader(client, settings.namespace, settings.group, models)
    try:
        reader.read()
        warn_of_absent(client, settings.namespace, models)
        if watch is None:
            sleep(interval)
            show(console, reader.read(), settings.group, as_json, reader.batches)
            return 0
        if as_json:
            while True:
                sleep(watch)
                show(console, reader.read(), settings.group, True, reader.batches)
        with Live(render(reader.read(), settings.group, reader.batches), console=console,
                  auto_refresh=False) as live:
            while True:
                sleep(watch)
                live.update(render(reader.read(), settings.group, reader.batches),
                            refresh=True)
    except redis.RedisError as exc:
        print(f"redbatch: cannot read stats from {redacted(url)}: {exc}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def stats_url(settings: Settings) -> str | None:
    """The Redis to read: the setting, else a local worker's embedded one; None (said)."""
    url = settings.redis_url or local_redis.local_url(settings.data_dir)
    if not url:
        print("redbatch: stats needs --redis-url or REDBATCH_REDIS_URL (or a worker "
              "running here with its embedded Redis, which writes .redbatch/redis.url)",
              file=sys.stderr)
    return url


def show(console: Console, rows: list[tuple[StreamStats, float | None]], group: str,
         as_json: bool, batches: list[dict[str, Any]] | None = None) -> None:
    """JSON: one line per reading, so `--watch --json` is a JSONL stream."""
    if as_json:
        print(json.dumps(to_json(rows, batches)), flush=True)
    else:
        console.print(render(rows, group, batches))


def warn_of_absent(client: redis.Redis, namespace: str, models: list[str] | None) -> None:
    """A model asked for by name that has no request stream: shown as zeros, and said so."""
    if not models:
        return
    found = set(discover_models(client, namespace))
    for model in models:
        if model not in found:
            print(f"redbatch: no request stream for model {model!r} in namespace "
                  f"{namespace!r} (yet)", file=sys.stderr)

