"""Failover and replication: a Sentinel master killed under load, and WAITs that come back short.

Each test starts its own rig (conftest.py: Debian's Redis 7 or REDIS_SERVER when 7+; skipped
without one). Replies are counted per request id: none may come twice. What a killed master
loses depends on replicas_to_wait: with WAIT (and the producer's idempotent resubmission) a
submitted request is on the replica before submit returns; without, the last XADDs a killed
master acknowledged may be lost (replication is asynchronous). Each outcome is printed as a
row of the fault table (run with -s to see it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY

from producer import Client, protocol
from producer.backlog import submitted_key
from tests.rigs.cluster import paused
from tests.rigs.sentinel import SentinelRig, sentinel_rig
from tests.rigs.servers import RedisNode, wait_until
from tests.rigs.workers import running_worker

REQUESTS = 300
KILL_AT = 100  # the master dies when this many requests have been submitted
SETTLE_S = 12.0  # after the last submit, how long replies may take to come in


@dataclass
class Outcome:
    submitted: dict[str, float] = field(default_factory=dict)  # id -> when submit returned
    replies: Counter[str] = field(default_factory=Counter)
    reply_times: dict[str, float] = field(default_factory=dict)  # id -> first reply
    killed_at: float = 0.0
    promoted_at: float = 0.0  # when the rig's failover was seen done (0: never)

    @property
    def lost(self) -> int:
        return sum(1 for i in self.submitted if not self.replies[i])

    @property
    def duplicated(self) -> int:
        return sum(1 for n in self.replies.values() if n > 1)

    def recovery_s(self) -> float:
        """From the kill to the first reply to a request submitted after it."""
        after = [self.reply_times[i] for i, t in self.submitted.items()
                 if t > self.killed_at and i in self.reply_times]
        return min(after) - self.killed_at if after else float("inf")

    def failover_s(self) -> float:
        """From the kill to the promotion: what the rig (Sentinel) took, not the clients."""
        return self.promoted_at - self.killed_at if self.promoted_at else float("inf")

    def row(self, scenario: str) -> str:
        return (f"| {scenario} | {len(self.submitted)} | {self.lost} | {self.duplicated} | "
                f"{self.recovery_s():.2f} s |")


def settle(outcome: Outcome, stop: threading.Event, collector: threading.Thread,
           settle_s: float = SETTLE_S) -> None:
    """Wait up to `settle_s` for the lost replies, then a moment for a late second one, and
    stop the collector."""
    settle_until = time.monotonic() + settle_s
    while outcome.lost and time.monotonic() < settle_until:
        time.sleep(0.1)
    time.sleep(0.5)  # a late second reply would show up now
    stop.set()
    collector.join(5)


def collect(client: Client, reply_to: str, outcome: Outcome, stop: threading.Event) -> None:
    """Pop every reply off the shared key, riding out the failover."""
    while not stop.is_set():
        try:
            popped = client.redis.blpop([reply_to], timeout=0.2)
            batch = [popped[1], *(client.redis.lpop(reply_to, 500) or [])] if popped else []
        except redis.RedisError:
            time.sleep(0.05)
            continue
        now = time.monotonic()
        for data in batch:
            request_id = protocol.decode_envelope(data)["id"]
            outcome.replies[request_id] += 1
            outcome.reply_times.setdefault(request_id, now)


def produce(client: Client, reply_to: str, outcome: Outcome, rig: SentinelRig,
            seed: int) -> None:
    """Seeded payloads at a steady pace; a submit that fails is sent again with its id."""
    rng = random.Random(seed)
    for i in range(REQUESTS):
        if i == KILL_AT:
            rig.master.kill()
            outcome.killed_at = time.monotonic()
        request_id = f"req-{seed}-{i}"
        submit_until_accepted(client, {"i": i, "r": rng.random()}, request_id, reply_to, 20)
        outcome.submitted[request_id] = time.monotonic()
        time.sleep(rng.uniform(0, 0.01))


def submit_until_accepted(client: Client, payload: dict[str, object], request_id: str,
                          reply_to: str, timeout_s: float) -> None:
    """Submit, retrying the same id while the failover refuses it (idempotent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.submit(payload, request_id=request_id, reply_to=reply_to)
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def watch_promotion(rig: SentinelRig, outcome: Outcome, stop: threading.Event) -> None:
    """outcome.promoted_at: when every sentinel first named the replica as the master."""
    while not stop.is_set():
        try:
            if rig.master_ports() == {rig.replica.port}:  # a client may ask any of them
                outcome.promoted_at = time.monotonic()
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)


def run_failover(rig: SentinelRig, replicas_to_wait: int, seed: int) -> Outcome:
    url, outcome, stop = rig.url(), Outcome(), threading.Event()
    reply_to = f"redbatch:reply:failover-{seed}"
    watcher = threading.Thread(target=watch_promotion, args=(rig, outcome, stop), daemon=True)
    watcher.start()
    with running_worker(url, "echo", replicas_to_wait=replicas_to_wait, shutdown_grace_s=5):
        producer = Client(url, "echo", replicas_to_wait=replicas_to_wait)
        collector = threading.Thread(target=collect, daemon=True,
                                     args=(Client(url, "echo"), reply_to, outcome, stop))
        collector.start()
        produce(producer, reply_to, outcome, rig, seed)
        settle(outcome, stop, collector)
        watcher.join(5)
    assert rig.master_port() == rig.replica.port, "Sentinel did not promote the replica"
    return outcome


@pytest.mark.parametrize(("replicas_to_wait", "scenario"), [
    (-1, "kill -9 Sentinel master, replicas_to_wait auto (WAIT 1 + resubmit)"),
    (0, "kill -9 Sentinel master, replicas_to_wait 0 (no WAIT)"),
])
def test_sentinel_failover_keeps_exactly_one_reply(redis7: Path, tmp_path: Path,
                                                   replicas_to_wait: int, scenario: str) -> None:
    """Every step is bounded (the rig's start, the submits' retries, SETTLE_S, the worker's
    stop), so the test cannot hang; how long Sentinel takes to fail over is not asserted.
    The clients' recovery is, from the promotion on."""
    with sentinel_rig(redis7, tmp_path) as rig:
        outcome = run_failover(rig, replicas_to_wait, seed=14)
    print(f"\n| scenario | submitted | lost | duplicated | recovery |\n{outcome.row(scenario)}"
          f"\nevery sentinel named the replica {outcome.failover_s():.2f} s after the kill")
    assert len(outcome.submitted) == REQUESTS
    assert outcome.duplicated == 0
    if replicas_to_wait:  # each submit returned after a replica had it
        assert outcome.lost == 0
    else:  # asynchronous replication may lose what the killed master acknowledged last
        assert outcome.lost <= KILL_AT
    assert outcome.promoted_at, "not every sentinel named the replica as the master"
    # the first reply to a request submitted after the kill, counted from the promotion
    assert outcome.recovery_s() - outcome.failover_s() < 10, outcome.row(scenario)


def wait_reports(node: RedisNode, replicas: int, timeout_ms: int) -> int:
    """How many replicas a WAIT after a write reports. WAIT returns as soon as `replicas`
    have acknowledged, so a long timeout costs nothing while they do."""
    with node.client(socket_timeout=timeout_ms / 1000 + 5) as client:
        pipe = client.pipeline(transaction=False)
        pipe.set("redbatch:probe", 1)
        pipe.wait(replicas, timeout_ms)
        return int(pipe.execute()[1])


def short_total() -> float:
    return REGISTRY.get_sample_value("redbatch_replication_short_total", {"model": "echo"}) or 0


def test_short_waits_resubmit_and_still_one_reply_each(
        replicated: tuple[RedisNode, RedisNode]) -> None:
    """Negative control: a replica that stops replicating (its process stopped, SIGSTOP)
    makes every WAIT short; the producer resubmits the same ids, which adds no second
    request. The replica is continued (SIGCONT) once each call was resubmitted and that
    came back short too (and, the first time, once a reply of the worker's was short), so
    the call can then finish with its WAIT met."""
    master, replica = replicated
    url = f"redis://127.0.0.1:{master.port}/0"
    assert wait_reports(master, 1, 10_000) == 1  # the control: a live replica acknowledges
    before = short_total()
    with running_worker(url, "echo", replicas_to_wait=1, replicas_wait_ms=50), \
            ThreadPoolExecutor(1) as pool:
        client = Client(url, "echo", replicas_to_wait=1, replicas_wait_ms=50)
        reply_to = client.new_reply_key()
        with paused(replica):
            assert wait_reports(master, 1, 100) == 0  # replication stopped: WAIT reports 0
            many = pool.submit(client.submit_many, [{"n": n} for n in range(50)],
                               reply_to=reply_to)
            wait_until(lambda: client.short_waits >= 2 and short_total() > before, 30,
                       "no resubmission, or no short WAIT of the worker's replies")
        ids = many.result(timeout=60)
        shorts = client.short_waits
        with paused(replica):
            one = pool.submit(client.submit, {"n": 50}, reply_to=reply_to)
            wait_until(lambda: client.short_waits >= shorts + 2, 30, "no resubmission")
        ids.append(one.result(timeout=60))
        envelopes = client.collect(reply_to, len(ids), timeout=30)
    assert client.short_waits >= 4  # both calls were resubmitted at least once
    assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each
    with master.client() as m:
        assert m.llen(reply_to) == 0  # none twice: the worker has stopped, nothing came late
        # no second request: the group answered as many entries as there are ids, and as
        # many were added (the stream itself is trimmed once they are acked)
        assert int(m.get(protocol.answered_key("redbatch", "echo")) or 0) == len(ids)
        stream = protocol.stream_key("redbatch", "echo")
        assert int(m.xinfo_stream(stream)["entries-added"]) == len(ids)
        assert all(m.exists(submitted_key("redbatch", i)) for i in ids)
    assert short_total() > before  # the worker's reply WAITs came back short too
    assert wait_reports(master, 1, 10_000) == 1  # and the replica is back
