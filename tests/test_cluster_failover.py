"""A master of a Redis Cluster killed with SIGKILL mid-load (tests/cluster_rig.py; its
replica is promoted), replies counted per id. It prints a row of the fault table (run with
-s to see it). The crash between a foreign push and its ack is in test_cluster.py."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import redis

from producer import Client
from tests.cluster_rig import ClusterRig, cluster_rig, cluster_worker
from tests.test_failover import Outcome, collect

REQUESTS = 300
KILL_AT = 100
SETTLE_S = 15.0


def produce(client: Client, reply_to: str, outcome: Outcome, kill: threading.Event,
            seed: int, submit_s: list[float]) -> None:
    """Paced submits; the master dies at KILL_AT; each submit's duration into `submit_s`."""
    rng = random.Random(seed)
    for i in range(REQUESTS):
        if i == KILL_AT:
            kill.set()
            while not outcome.killed_at:
                time.sleep(0.001)
        request_id = f"req-{seed}-{i}"
        began = time.monotonic()
        deadline = began + 30
        while True:
            try:
                client.submit({"i": i}, request_id=request_id, reply_to=reply_to)
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        outcome.submitted[request_id] = time.monotonic()
        submit_s.append(outcome.submitted[request_id] - began)
        time.sleep(rng.uniform(0, 0.01))


def test_master_killed_mid_run_keeps_exactly_one_reply(redis7: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    with cluster_rig(redis7, tmp_path) as rig:
        url, outcome, stop, kill = rig.url(), Outcome(), threading.Event(), threading.Event()
        reply_to = "redbatch:reply:cluster-failover"
        holder = rig.master_of(reply_to)
        victim = next(m for m in rig.masters() if m is not holder)
        promoted_at: list[float] = []
        submit_s: list[float] = []
        with cluster_worker(url, replicas_to_wait=-1, shutdown_grace_s=5):
            producer = Client(url, "echo", cluster=True, replicas_to_wait=-1)
            collector = threading.Thread(target=collect, daemon=True, args=(
                Client(url, "echo", cluster=True), reply_to, outcome, stop))
            collector.start()
            feeder = threading.Thread(target=produce, daemon=True,
                                      args=(producer, reply_to, outcome, kill, 14, submit_s))
            feeder.start()
            kill.wait(30)
            victim.kill()
            outcome.killed_at = time.monotonic()
            threading.Thread(target=wait_promoted, args=(rig, promoted_at), daemon=True).start()
            feeder.join(60)
            settle_until = time.monotonic() + SETTLE_S
            while outcome.lost and time.monotonic() < settle_until:
                time.sleep(0.1)
            time.sleep(0.5)  # a late second reply would show up now
            stop.set()
            collector.join(5)
        failover_s = promoted_at[0] - outcome.killed_at if promoted_at else float("inf")
    print(f"\n| scenario | submitted | lost | duplicated | recovery |\n"
          f"{outcome.row('kill -9 of a cluster master, replicas_to_wait auto')}\n"
          f"replica promoted {failover_s:.2f} s after the kill; the first reply after the "
          f"kill came {first_reply_s(outcome):.2f} s after it; the longest wait for a reply "
          f"(from its submit) {longest_wait_s(outcome):.2f} s; the longest submit (a request "
          f"to the killed master's shards, resubmitted) {max(submit_s):.2f} s")
    assert len(outcome.submitted) == REQUESTS
    assert outcome.duplicated == 0
    assert outcome.lost == 0
    assert failover_s < 15 and outcome.recovery_s() < 15
    assert time.monotonic() - started < 90


def first_reply_s(outcome: Outcome) -> float:
    after = [t for t in outcome.reply_times.values() if t > outcome.killed_at]
    return min(after) - outcome.killed_at if after else float("inf")


def longest_wait_s(outcome: Outcome) -> float:
    """From a request's submit returning to its reply: the outage its shard saw."""
    return max((outcome.reply_times[i] - t for i, t in outcome.submitted.items()
                if i in outcome.reply_times), default=float("inf"))


def wait_promoted(rig: ClusterRig, promoted_at: list[float]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if len(rig.masters()) == 3:
                promoted_at.append(time.monotonic())
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
