"""Faults of a Redis Cluster master mid-load (tests/rigs/cluster.py), replies counted per id:
a master killed with SIGKILL (its replica is promoted), and a manual `CLUSTER FAILOVER` sent
to a replica (a coordinated switch: the master pauses its clients until the replica has
caught up). Each prints a row of the fault table (run with -s to see it). The crash between
a foreign push and its ack is in test_cluster.py."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from producer import Client
from tests.redis.sentinel.test_failover import Outcome, collect, settle, submit_until_accepted
from tests.rigs.cluster import ClusterRig, cluster_rig, cluster_worker
from tests.rigs.servers import RedisNode

REQUESTS = 300
KILL_AT = 100
SETTLE_S = 15.0
REPLY_TO = "redbatch:reply:cluster-failover"


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
        submit_until_accepted(client, {"i": i}, request_id, reply_to, 30)
        outcome.submitted[request_id] = time.monotonic()
        submit_s.append(outcome.submitted[request_id] - began)
        time.sleep(rng.uniform(0, 0.01))


@dataclass
class Run:
    """What one fault under load gave: the replies, when the new master took over, and how
    long each submit took."""

    outcome: Outcome = field(default_factory=Outcome)
    promoted_at: list[float] = field(default_factory=list)
    submit_s: list[float] = field(default_factory=list)

    def failover_s(self) -> float:
        at = self.promoted_at
        return at[0] - self.outcome.killed_at if at else float("inf")


def under_load(rig: ClusterRig, inject: Callable[[], None], promoted: Callable[[], bool],
               seed: int) -> Run:
    """REQUESTS echo requests through one worker (WAIT on), `inject` run after KILL_AT of
    them, `promoted` polled from then on; returns once every reply came (or SETTLE_S).
    Every step is bounded (the submits' retries, the joins, SETTLE_S, the worker's stop),
    so no test built on it can hang; none asserts a total time."""
    url, run, stop, kill = rig.url(), Run(), threading.Event(), threading.Event()
    outcome = run.outcome
    with cluster_worker(url, replicas_to_wait=-1, shutdown_grace_s=5):
        producer = Client(url, "echo", cluster=True, replicas_to_wait=-1)
        collector = threading.Thread(target=collect, daemon=True, args=(
            Client(url, "echo", cluster=True), REPLY_TO, outcome, stop))
        collector.start()
        feeder = threading.Thread(target=produce, daemon=True, args=(
            producer, REPLY_TO, outcome, kill, seed, run.submit_s))
        feeder.start()
        kill.wait(30)
        inject()
        outcome.killed_at = time.monotonic()
        threading.Thread(target=wait_promoted, args=(promoted, run.promoted_at),
                         daemon=True).start()
        feeder.join(60)
        settle(outcome, stop, collector, SETTLE_S)
    return run


def report(run: Run, scenario: str, fault: str) -> None:
    outcome = run.outcome
    print(f"\n| scenario | submitted | lost | duplicated | recovery |\n"
          f"{outcome.row(scenario)}\n"
          f"replica promoted {run.failover_s():.2f} s after the {fault}; the first reply "
          f"after it came {first_reply_s(outcome):.2f} s after it; the longest wait for a "
          f"reply (from its submit) {longest_wait_s(outcome):.2f} s; the longest submit (a "
          f"request to the failed master's shards, resubmitted) {max(run.submit_s):.2f} s")


def assert_exactly_once(run: Run) -> None:
    assert len(run.outcome.submitted) == REQUESTS
    assert run.outcome.duplicated == 0
    assert run.outcome.lost == 0
    assert run.promoted_at, "the replica never took over"  # within wait_promoted's 30 s
    # How long the cluster takes to promote is not asserted; the clients' recovery is,
    # from the promotion on: the first reply to a request submitted after the fault, and
    # the longest submit (one to the failed master's shards, begun after the fault, which
    # is accepted only once the new master has the slots).
    assert run.outcome.recovery_s() - run.failover_s() < 10, run.outcome.row("recovery")
    assert max(run.submit_s) - run.failover_s() < 10, (max(run.submit_s), run.failover_s())


def kill_a_master(binary: Path, directory: Path, seed: int, scenario: str) -> None:
    """kill -9 of a master (not the reply key's) mid-load: one reply each, recovered."""
    with cluster_rig(binary, directory) as rig:
        holder = rig.master_of(REPLY_TO)
        victim = next(m for m in rig.masters() if m is not holder)
        run = under_load(rig, victim.kill, lambda: len(rig.masters()) == 3, seed=seed)
    report(run, scenario, "kill")
    assert_exactly_once(run)


def test_master_killed_mid_run_keeps_exactly_one_reply(redis7: Path, tmp_path: Path) -> None:
    kill_a_master(redis7, tmp_path, 14, "kill -9 of a cluster master, replicas_to_wait auto")


def test_manual_failover_mid_run_keeps_exactly_one_reply(redis7: Path,
                                                         tmp_path: Path) -> None:
    """`CLUSTER FAILOVER` to the replica of a master that does not hold the shared reply
    key: the old master answers MOVED (or is paused) while the replica takes its slots."""
    with cluster_rig(redis7, tmp_path) as rig:
        holder = rig.master_of(REPLY_TO)
        victim = next(m for m in rig.masters() if m is not holder)
        replica = rig.replica_of(victim)
        run = under_load(rig, lambda: manual_failover(replica),
                         lambda: switched(rig, replica, victim), seed=15)
    report(run, "CLUSTER FAILOVER to a replica, replicas_to_wait auto", "CLUSTER FAILOVER")
    assert_exactly_once(run)


def manual_failover(replica: RedisNode) -> None:
    with replica.client() as client:
        assert client.execute_command("CLUSTER", "FAILOVER") in (b"OK", "OK", True)


def switched(rig: ClusterRig, replica: RedisNode, old_master: RedisNode) -> bool:
    """The replica is a master and the old master its replica."""
    return rig.role(replica) == "master" and rig.role(old_master) == "slave"


def first_reply_s(outcome: Outcome) -> float:
    after = [t for t in outcome.reply_times.values() if t > outcome.killed_at]
    return min(after) - outcome.killed_at if after else float("inf")


def longest_wait_s(outcome: Outcome) -> float:
    """From a request's submit returning to its reply: the outage its shard saw."""
    return max((outcome.reply_times[i] - t for i, t in outcome.submitted.items()
                if i in outcome.reply_times), default=float("inf"))


def wait_promoted(promoted: Callable[[], bool], promoted_at: list[float]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if promoted():
                promoted_at.append(time.monotonic())
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
