"""Echo through one worker process on a 3-master Redis Cluster (6 shards) against one Redis, side by
side in one run: `python -m bench.redis_cluster`. On a 2-core machine this measures the cluster's
overhead, not its scaling: six nodes, worker and producer share the cores. Each repeat, per target:
the real producer (`Client.submit_many`) queues `--requests` echo requests while no worker runs,
then one `python -m worker` drains them. Throughput and the drain's CPU are taken between 10 % and
90 % of the requests answered (the replies counters, every shard's `answered` key), leaving out the
worker's start-up and the tail. Redis CPU per request: `used_cpu_sys + used_cpu_user` (INFO cpu)
summed over every node (masters and replicas), queueing's over all the requests plus the drain's
over those answered in that window; the worker's from its process's CPU times, in the same window.
The share per master counts each shard's requests on its master. WAIT: the cluster with
`replicas_to_wait` 1 (worker and producer) against 0. Needs Redis 7+, redis-cli and pytest
(tests/rigs/cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.common.paths import results_dir
from bench.common.processes import Workers
from producer import Client, protocol
from producer.shards import shard_answered_key, shard_stream_key
from tests.rigs.cluster import ClusterRig, cluster_rig
from tests.rigs.servers import RedisNode, server_version, system_redis

SHARDS = 6
MODEL = "echo"
# As bench/throughput/measure.py's overhead pool: no compute, so big reads and batches.
ECHO = {"model": MODEL, "model_options": {}, "max_batch_size": 512, "read_count": 1024,
        "max_inflight": 4096, "max_batch_tokens": 1 << 20, "shutdown_grace_s": 5}
SINGLE_LINES = ["appendonly yes", "appendfsync everysec", "save \"\"",
                "maxmemory-policy noeviction"]  # the cluster nodes' data settings
PAYLOAD = protocol.encode({"text": "the quick brown fox"}, protocol.MSGPACK)
RESULTS = results_dir("redis_cluster")
POLL_S = 0.005
WORKER = -1  # the worker process's key in a CPU snapshot (the nodes' are their ports)


@dataclass
class Target:
    name: str
    url: str
    nodes: list[RedisNode]  # every node whose CPU counts
    cluster: bool
    replicas_to_wait: int


def cpu_s(nodes: list[RedisNode]) -> dict[int, float]:
    """Each node's CPU seconds so far (INFO cpu: sys + user), by port."""
    seconds = {}
    for node in nodes:
        with node.client() as client:
            info = client.info("cpu")
        seconds[node.port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return seconds


def command_usec(nodes: list[RedisNode]) -> dict[str, int]:
    """Microseconds spent in each command so far, summed over the nodes (INFO commandstats;
    a script's time includes the commands it calls, also counted on their own)."""
    total: dict[str, int] = {}
    for node in nodes:
        with node.client() as client:
            for name, stats in client.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                total[command] = total.get(command, 0) + int(stats["usec"])
    return total


def answered_keys(target: Target, namespace: str) -> list[str]:
    if not target.cluster:
        return [protocol.answered_key(namespace, MODEL)]
    return [shard_answered_key(namespace, MODEL, s) for s in range(SHARDS)]


def answered(client: Any, keys: list[str]) -> int:
    return sum(int(client.get(key) or 0) for key in keys)


def worker_cpu_s(pool: Workers) -> float:
    times = psutil.Process(pool.processes[0].pid).cpu_times()
    return float(times.user + times.system)


def drain_rate(client: Any, snapshot: Callable[[], dict[int, float]], keys: list[str],
               requests: int, timeout_s: float = 120.0) -> tuple[float, dict[int, float]]:
    """Between 10 % and 90 % of the requests answered (the worker's start-up and the tail
    left out): (requests/s, CPU seconds per request by node port and WORKER)."""
    marks: list[tuple[float, int, dict[int, float]]] = []
    deadline = time.monotonic() + timeout_s
    while (done := answered(client, keys)) < requests or len(marks) < 2:
        if len(marks) < 2 and done >= int(requests * (0.1, 0.9)[len(marks)]):
            marks.append((time.monotonic(), done, snapshot()))
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"{done} of {requests} answered after {timeout_s} s")
        time.sleep(POLL_S)
    (t0, n0, cpu0), (t1, n1, cpu1) = marks
    if n1 - n0 < requests // 2:  # one poll saw most of it: CPU times move in 10 ms ticks
        raise RuntimeError(f"{n1 - n0} of {requests} timed: too fast, raise --requests")
    return (n1 - n0) / (t1 - t0), {k: (cpu1[k] - cpu0[k]) / (n1 - n0) for k in cpu1}


def per_master(target: Target, namespace: str) -> dict[str, int]:
    """Requests answered on each master (by port), from its shards' counters."""
    with redis.RedisCluster.from_url(target.url) as client:
        counts = {k: (str(client.get_node_from_key(k).port), int(client.get(k) or 0))
                  for k in answered_keys(target, namespace)}
    return {p: sum(n for q, n in counts.values() if q == p) for p, _ in counts.values()}


def run_once(target: Target, rig: ClusterRig, namespace: str, requests: int,
             log_dir: Path) -> dict[str, Any]:
    """Queue `requests` with the real producer, then drain them with one fresh worker."""
    producer = Client(target.url, MODEL, namespace=namespace, cluster=target.cluster,
                      replicas_to_wait=target.replicas_to_wait)
    keys = answered_keys(target, namespace)
    masters = [n for n in target.nodes if n.port in {m.port for m in rig.masters()}] \
        if target.cluster else target.nodes
    commands = command_usec(masters)
    before = cpu_s(target.nodes)
    started = time.monotonic()
    producer.submit_many([PAYLOAD] * requests)
    submit_rate = requests / (time.monotonic() - started)
    staged = cpu_s(target.nodes)
    settings = {**ECHO, "replicas_to_wait": target.replicas_to_wait}
    if target.cluster:
        settings.update(redis_cluster=True, shards=SHARDS)
    with Workers(target.url, namespace, 1, log_dir, **settings) as pool:
        def snapshot() -> dict[int, float]:
            return {**cpu_s(target.nodes), WORKER: worker_cpu_s(pool)}
        rate, drained = drain_rate(producer.redis, snapshot, keys, requests)
        short = sum(v for (name, _), v in pool.metrics().items()
                    if name == "redbatch_replication_short_total")
    producer.redis.close()
    worker_s = drained.pop(WORKER)
    staging = {p: (staged[p] - before[p]) / requests for p in staged}
    used = sum(staging.values()) + sum(drained.values())
    used_masters = sum(staging[n.port] + drained[n.port] for n in masters)
    spent = {c: (u - commands.get(c, 0)) / requests for c, u in command_usec(masters).items()}
    result: dict[str, Any] = {
        "rate": rate, "submit_rate": submit_rate, "cpu_us_per_request": used * 1e6,
        "master_cpu_us_per_request": used_masters * 1e6, "short_waits": short,
        "worker_cpu_us_per_request": worker_s * 1e6,
        "master_command_us_per_request": {c: u for c, u in spent.items() if u >= 0.05}}
    if target.cluster:
        result["per_master"] = per_master(target, namespace)
    return result


def summarise(runs: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    """Medians over the repeats (and every repeat's figures)."""
    summary: dict[str, Any] = {"runs": runs}
    for field in ("rate", "submit_rate", "cpu_us_per_request", "master_cpu_us_per_request",
                  "worker_cpu_us_per_request"):
        summary[field] = statistics.median(run[field] for run in runs)
    commands = {c for run in runs for c in run["master_command_us_per_request"]}
    summary["master_command_us_per_request"] = {c: statistics.median(
        run["master_command_us_per_request"].get(c, 0.0) for run in runs) for c in commands}
    if "per_master" in runs[0]:
        total = requests * len(runs)
        ports = sorted({p for run in runs for p in run["per_master"]})
        summary["share_per_master"] = {
            p: sum(run["per_master"].get(p, 0) for run in runs) / total for p in ports}
    return summary


@contextmanager
def rigs(binary: Path, directory: Path) -> Iterator[tuple[RedisNode, ClusterRig]]:
    """One Redis (AOF, no replica) and a 3 + 3 cluster, both up for the whole run."""
    single = RedisNode(binary, directory / "single", SINGLE_LINES)
    with ExitStack() as stack:
        stack.callback(single.stop)
        single.start()
        rig = stack.enter_context(cluster_rig(binary, directory / "cluster"))
        yield single, rig


def targets(single: RedisNode, rig: ClusterRig) -> list[Target]:
    url = f"redis://127.0.0.1:{single.port}/0"
    return [Target("one Redis", url, [single], False, 0),
            Target("cluster, replicas_to_wait 0", rig.url(), rig.live(), True, 0),
            Target("cluster, replicas_to_wait 1", rig.url(), rig.live(), True, 1)]


def measure(requests: int, repeats: int, directory: Path) -> dict[str, Any]:
    binary = system_redis()
    if binary is None or not shutil.which("redis-cli"):
        raise SystemExit("needs Redis 7+ (redis-server on PATH, or REDIS_SERVER) and redis-cli")
    runs: dict[str, list[dict[str, Any]]] = {}
    with rigs(binary, directory) as (single, rig):
        for repeat in range(repeats):
            for index, target in enumerate(targets(single, rig)):
                namespace = f"cb{repeat}-{index}"
                run = run_once(target, rig, namespace, requests, directory)
                runs.setdefault(target.name, []).append(run)
                print(f"repeat {repeat} {target.name}: {run['rate']:.0f} req/s, "
                      f"{run['cpu_us_per_request']:.1f} us Redis CPU/request", flush=True)
        spread = tag_spread(rig)
    return {"engine": f"redis {server_version(binary)}", "requests": requests,
            "repeats": repeats, "shards": SHARDS, "worker_settings": ECHO, "machine": {
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "processor": platform.processor() or platform.machine()},
            "targets": {n: summarise(r, requests) for n, r in runs.items()}, "spread": spread}


def tag_spread(rig: ClusterRig, others: int = 1000) -> dict[str, Any]:
    """Each master's share of a round-robin producer's requests for other model names (the
    CRC16 of their shards' tags, this cluster's slot table): the bundled models', and the
    fraction of `others` made-up names that meet 33 +- 8 % on every master."""
    masters = [n.port for n in rig.masters()]
    with redis.RedisCluster.from_url(rig.url()) as client:
        def shares(model: str) -> list[float]:
            ports = [client.get_node_from_key(shard_stream_key(
                protocol.DEFAULT_NAMESPACE, model, s)).port for s in range(SHARDS)]
            return [ports.count(port) / SHARDS for port in masters]
        named = {m: shares(m) for m in ("echo", "minilm", "smollm2")}
        even = sum(all(0.25 <= x <= 0.41 for x in shares(f"model{i}")) for i in range(others))
    return {"models": named, "even_share": even / others, "names_tried": others}


def derived(result: dict[str, Any]) -> dict[str, float]:
    """The ratios the issue asks for."""
    t = result["targets"]
    one, c0, c1 = t.values()  # in the order of targets()
    paired = [1 - b["rate"] / a["rate"] for a, b in zip(c0["runs"], c1["runs"], strict=True)]
    return {"cluster_vs_one": c0["rate"] / one["rate"],
            "wait_cost": 1 - c1["rate"] / c0["rate"],
            "wait_cost_paired": statistics.median(paired),  # each repeat's own pair
            "wait_cost_submit": 1 - c1["submit_rate"] / c0["submit_rate"],
            "share_min": min(c0["share_per_master"].values()),
            "share_max": max(c0["share_per_master"].values())}


def markdown(result: dict[str, Any], command: str) -> str:
    d, sp = result["derived"], result["spread"]
    lines = [f"# Redis Cluster vs one Redis, echo through one worker ({result['date']})", "",
             f"`{command}` on {result['machine']['cpus']} CPUs "
             f"({result['machine']['processor']}), {result['engine']}; {result['requests']} "
             f"requests per run, medians of {result['repeats']} repeats, targets interleaved. "
             f"Cluster: 3 masters + 3 replicas (AOF), {result['shards']} shards; one Redis: "
             "AOF, no replica. Worker settings " + json.dumps(result["worker_settings"]), "",
             "| target | drain req/s | producer submit req/s | Redis CPU µs/request "
             "(all nodes) | of which masters | worker CPU µs/request | share per master |",
             "|---|---|---|---|---|---|---|"]
    for name, t in result["targets"].items():
        share = ", ".join(f"{v:.1%}" for v in t.get("share_per_master", {}).values()) or "—"
        lines.append(f"| {name} | {t['rate']:.0f} | {t['submit_rate']:.0f} | "
                     f"{t['cpu_us_per_request']:.1f} | {t['master_cpu_us_per_request']:.1f} | "
                     f"{t['worker_cpu_us_per_request']:.1f} | {share} |")
    lines += ["", f"- cluster (replicas_to_wait 0) / one Redis: {d['cluster_vs_one']:.2f}",
              f"- cost of WAIT (replicas_to_wait 1 vs 0, drain): {d['wait_cost']:.1%} "
              f"(goal <= 10 %); median of each repeat's pair: {d['wait_cost_paired']:.1%}; "
              f"on the producer's submit_many: {d['wait_cost_submit']:.1%}",
              f"- share per master: {d['share_min']:.1%} to {d['share_max']:.1%} "
              "(goal 33 +- 8 %)", "- the same spread for other model names (their tags' "
              "slots, this cluster): " + ", ".join(
                  f"{m} {'/'.join(f'{x:.0%}' for x in v)}" for m, v in sp["models"].items())
              + f"; {sp['even_share']:.0%} of {sp['names_tried']} made-up names meet the goal",
              "", "Where the masters' time goes, µs per request (INFO "
              "commandstats; a script's time includes the commands it calls):", ""]
    for name, t in result["targets"].items():
        spent = sorted(t["master_command_us_per_request"].items(), key=lambda kv: -kv[1])
        lines.append(f"- {name}: " + ", ".join(f"{c} {u:.2f}" for c, u in spent[:8]))
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_cluster",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "2026-12-01-cluster"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="redbatch-cluster-bench-") as directory:
        result = measure(args.requests, args.repeats, Path(directory))
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["derived"] = derived(result)
    command = " ".join(["python -m bench.redis_cluster", *(sys.argv[1:] if argv is None
                                                          else argv)])
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(result, command))
    print(markdown(result, command))

