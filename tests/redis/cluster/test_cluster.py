"""Redis Cluster sharding on a real 3-master + 3-replica cluster (tests/rigs/cluster.py):
echo requests through the sharded streams with exactly one reply each, to default reply
keys and to a shared `reply_to` in another slot, `stats` per shard, max_backlog moving on,
WAIT on the write's node, a worker killed with SIGKILL whose entries another worker
reclaims, and one killed between the push to a foreign `reply_to` and its XACK."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from producer import AsyncClient, Client, Overloaded, connection, protocol, request_entry
from producer.backlog import ShardCycle
from producer.replicas import ReplicaCount
from producer.shards import key_slot, shard_reply_key, shard_stream_key
from tests.rigs.cluster import ClusterRig, cluster, cluster_worker, paused, rig
from tests.rigs.paths import REPO_ROOT
from tests.rigs.servers import wait_until
from worker.streams.replier import Reply
from worker.streams.shard_replies import ForeignReplies

__all__ = ["cluster", "rig"]  # the fixtures, imported for pytest
ROOT = REPO_ROOT


def shard_lengths(client: redis.RedisCluster, count: int) -> list[int]:
    """Entries ever added per shard (XINFO STREAM's entries-added survives trimming)."""
    return [int(client.xinfo_stream(shard_stream_key("redbatch", "echo", s))
                ["entries-added"]) for s in range(count)]


def listed_models(url: str) -> list[str]:
    """What the gateway's /v1/models would list, read from the cluster's model registry."""
    from producer.gateway.discovery import Discovery

    async def read() -> list[str]:
        client = connection.async_client(url, cluster=True)
        try:
            found = await Discovery(client, "redbatch", "workers", 30, 0).live_models()
        finally:
            await client.aclose()
        return [listed.name for listed in found]

    return asyncio.run(read())


def test_echo_through_sharded_streams_one_reply_each(rig: ClusterRig,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = rig.url()
    client = Client(url, "echo", cluster=True)
    assert client.cycle is not None and client.cycle.count == 6  # 2 x 3 masters
    assert client.redis.get("redbatch:shards:echo") == b"6"
    with cluster_worker(url, replicas_to_wait=1):
        own = client.submit_many([{"n": n} for n in range(120)])  # default reply keys
        assert [client.result(i, timeout=20) for i in own] == [{"n": n} for n in range(120)]
        shared = client.new_reply_key()  # one list, in some other slot: ForeignReplies
        ids = client.submit_many([{"m": n} for n in range(180)], reply_to=shared)
        ids.append(client.submit({"m": 180}, reply_to=shared))
        envelopes = client.collect(shared, len(ids), timeout=30)  # returns once all came
        assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each
        assert client.infer({"one": 1}, timeout=10) == {"one": 1}
        assert listed_models(url) == ["echo"]  # the registry, in another slot (issue 30)
    assert client.redis.llen(shared) == 0  # none twice: the worker stopped, nothing came late
    added = shard_lengths(client.redis, 6)
    assert sum(added) == 302 and min(added) >= 40  # round-robin: every shard had its share
    from worker.commands.stats import run_stats
    from worker.settings import load_settings

    settings = load_settings(None, redis_url=url, redis_cluster=True, model="echo")
    assert run_stats(settings, None, None, True, 0.0, sleep=lambda _: None) == 0
    [model] = json.loads(capsys.readouterr().out.splitlines()[-1])["models"]
    assert model["model"] == "echo" and model["answered"] == 302 and model["backlog"] == 0
    assert [s["shard"] for s in model["shards"]] == list(range(6))
    assert len({s["node"] for s in model["shards"]}) == 3  # spread over the three masters
    client.close()


def test_backlog_moves_on_to_the_next_shard_then_refuses(rig: ClusterRig) -> None:
    """max_backlog 12 over 6 shards: 2 each. A full shard passes a request to the next."""
    client = Client(rig.url(), "echo", cluster=True, max_backlog=12, replicas_to_wait=0)
    for _ in range(3):  # always offered to shard 0: two fit, the third goes to shard 1
        client.cycle = ShardCycle(6, start=0)
        last = client.submit({"n": 0})
    lengths = [client.redis.xlen(shard_stream_key("redbatch", "echo", s))
               for s in range(6)]
    assert lengths == [2, 1, 0, 0, 0, 0]
    assert client.reply_key(last) == shard_reply_key("redbatch", "echo", 1, last)
    client.submit_many([{"n": n} for n in range(9)])  # fills every shard to its share
    with pytest.raises(Overloaded):
        client.submit({"n": 12})
    client.close()


def test_async_client_on_a_cluster(rig: ClusterRig) -> None:
    import asyncio

    async def run() -> list[object]:
        client = AsyncClient(rig.url(), "echo", cluster=True)
        try:
            return list(await asyncio.gather(*(client.infer({"a": n}, timeout=20)
                                               for n in range(12))))
        finally:
            await client.close()

    with cluster_worker(rig.url()):
        assert asyncio.run(run()) == [{"a": n} for n in range(12)]


def worker_process(url: str, log: Path, **settings: object) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "worker", "run", "--redis-url", url, "--redis-cluster",
               "true", "--metrics-port", "0", "--device", "cpu", "--log-level", "warning"]
    for name, value in settings.items():
        command += ["--" + name.replace("_", "-"),
                    json.dumps(value) if isinstance(value, dict) else str(value)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)


def test_worker_killed_mid_run_is_reclaimed_by_another(rig: ClusterRig, tmp_path: Path) -> None:
    """Worker A (a process) holds entries when it gets SIGKILL; worker B claims them after
    claim_idle_ms and every request is answered once."""
    url = rig.url()
    client = Client(url, "echo", cluster=True)
    victim = worker_process(url, tmp_path / "a.log", model="echo", consumer="victim",
                            model_options={"per_item_ms": 20}, max_batch_size=4,
                            max_inflight=64, warmup="false")
    try:
        shared = client.new_reply_key()
        ids = client.submit_many([{"n": n} for n in range(150)], reply_to=shared)
        wait_until(lambda: client.redis.llen(shared) >= 10, 60, "worker A never answered")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        envelopes = client.collect(shared, len(ids), timeout=0.5)  # what A answered
        with cluster_worker(url, consumer="rescuer", claim_idle_ms=1000):
            # returns once every reply came; the limit only guards against a hang
            envelopes += client.collect(shared, len(ids) - len(envelopes), timeout=90)
        assert client.redis.llen(shared) == 0  # none twice: B stopped, nothing came late
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    answered_by = Counter(e["meta"]["worker"] for e in envelopes)
    assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each, none twice
    assert answered_by["victim"] >= 10 and answered_by["rescuer"] > 0
    assert time.monotonic() > 0
    client.close()


def test_wait_runs_on_the_writes_node_and_short_waits_resubmit(rig: ClusterRig) -> None:
    """WAIT must go on the connection of the write: with the replica of shard 0's master
    stopped (SIGSTOP), WAITs for shard 0 come back short (a WAIT on another node, or on a
    connection without writes, would not) and the producer resubmits the same ids, which
    adds nothing twice; the other shards' WAITs are met (a long WAIT timeout: WAIT returns
    as soon as the replica acknowledges). The replica is continued (SIGCONT) once shard 0's
    write was resubmitted and that came back short too."""
    url = rig.url()
    met = Client(url, "echo", cluster=True, replicas_to_wait=1, replicas_wait_ms=5000)
    client = Client(url, "echo", cluster=True, replicas_to_wait=1, replicas_wait_ms=50)
    assert met.cycle is not None and client.cycle is not None
    stream = shard_stream_key("redbatch", "echo", 0)
    replica = rig.replica_of(rig.master_of(stream))
    with cluster_worker(url, replicas_to_wait=1, replicas_wait_ms=50), \
            ThreadPoolExecutor(1) as pool:
        met.cycle = ShardCycle(6, start=1)
        reply_to = met.new_reply_key()
        ids = met.submit_many([{"n": n} for n in range(5)], reply_to=reply_to)  # 1..5
        assert met.short_waits == 0  # replicas of shards 1-5 answered their WAITs
        client.cycle = ShardCycle(6, start=0)  # shard 0 first, then 1..5
        with paused(replica):
            sending = pool.submit(client.submit_many, [{"n": n} for n in range(5, 11)],
                                  reply_to=reply_to)
            wait_until(lambda: client.short_waits >= 2, 30, "shard 0 was not resubmitted")
        ids += sending.result(timeout=60)
        assert client.short_waits >= 2  # shard 0's WAIT, on its master's connection
        envelopes = client.collect(reply_to, len(ids), timeout=30)  # returns once all came
    assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each
    assert client.redis.llen(reply_to) == 0  # none twice: the worker stopped, none came late
    assert client.redis.xinfo_stream(stream)["entries-added"] == 1  # not resubmitted twice
    met.close()
    client.close()


def test_producer_cli_on_a_cluster(rig: ClusterRig, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from producer.cli import main

    (tmp_path / "in.txt").write_text("".join(f"line {n}\n" for n in range(40)))
    with cluster_worker(rig.url()):
        assert main(["--model", "echo", "--redis-url", rig.url(), "--redis-cluster",
                     "--no-progress", str(tmp_path / "in.txt")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{\"id\"")]
    assert [e["result"] for e in lines] == [{"text": f"line {n}"} for n in range(40)]


def test_a_crash_between_the_foreign_push_and_the_ack_gives_one_push(
        rig: ClusterRig) -> None:
    """The dying worker pushed the reply to a foreign `reply_to` (step 1) and never acked
    (step 2). The entry comes back to another worker, which answers it: the marker makes
    its push a no-op, and it acks. The client sees exactly one reply."""
    url = rig.url()
    client = Client(url, "echo", cluster=True)
    reply_to = client.new_reply_key()
    stream = shard_stream_key("redbatch", "echo", 0)
    r = client.redis
    r.xgroup_create(stream, "workers", id="0", mkstream=True)
    fields = request_entry.entry_fields("req-x", protocol.encode(1, protocol.MSGPACK),
                                        reply_to=reply_to)
    entry_id = r.xadd(stream, fields).decode()
    r.xreadgroup("workers", "dying", {stream: ">"}, count=1)  # it holds the entry
    assert key_slot(reply_to) != key_slot(stream)
    dying = ForeignReplies(r, "redbatch", 60_000, "echo", ReplicaCount(0))
    envelope = protocol.encode(protocol.success_envelope("req-x", "first", {}), protocol.MSGPACK)
    dying.push(stream, [Reply(entry_id, reply_to, envelope)])  # step 1, then it dies
    with cluster_worker(url, consumer="heir", claim_idle_ms=500):
        # idle past claim_idle_ms, claimed, answered (push skipped), acked
        wait_until(lambda: r.xpending(stream, "workers")["pending"] == 0, 30,
                   "the heir did not claim and ack the entry")
    replies = [protocol.decode_envelope(d) for d in r.lrange(reply_to, 0, -1)]
    print(f"\n| worker killed between the foreign LPUSH and the XACK | 1 | "
          f"{1 - len(replies)} | {max(0, len(replies) - 1)} | — |")
    assert Counter(e["id"] for e in replies) == {"req-x": 1}
    assert replies[0]["result"] == "first"  # the dying worker's push, the heir's skipped
    client.close()


def test_hostile_entries_are_answered_in_the_shards_slot(rig: ClusterRig) -> None:
    """Issue 30 on a cluster: a reply_to outside the reply keys is answered on the shard's
    default reply key, and a second entry with an id in flight is answered duplicate_id
    (the in-flight marks are a pipeline across slots)."""
    url = rig.url()
    client = Client(url, "echo", cluster=True)
    stream = shard_stream_key("redbatch", "echo", 0)
    with cluster_worker(url):
        client.redis.xadd(stream, {"id": "evil", "payload": json.dumps(1),
                                   "content_type": protocol.JSON,
                                   "reply_to": "redbatch:requests:other"})
        for value in (1, 2):
            client.redis.xadd(stream, {"id": "twice", "payload": json.dumps(value),
                                       "content_type": protocol.JSON})
        evil = client.redis.blpop([shard_reply_key("redbatch", "echo", 0, "evil")],
                                  timeout=20)
        twice = [client.redis.blpop([shard_reply_key("redbatch", "echo", 0,
                                                              "twice")], timeout=20)
                 for _ in range(2)]
    assert evil is not None
    assert protocol.decode_envelope(evil[1])["error"]["field"] == "reply_to"
    outcomes = sorted(str(e.get("result") or e["error"]["code"])
                      for e in (protocol.decode_envelope(p[1]) for p in twice if p))
    assert outcomes == ["1", "duplicate_id"]
    assert not client.redis.exists("redbatch:requests:other")
