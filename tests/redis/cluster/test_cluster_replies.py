"""The sharded replier on a real 3-master + 3-replica cluster (tests/rigs/cluster.py): every
shard's write (foreign push, reply-and-ack, each with its WAIT) runs at the same time, and a
shard whose write fails is deferred while the other shards are answered."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from producer import connection
from producer.shards import key_slot, shard_reply_key, shard_stream_key
from tests.rigs.cluster import ClusterRig, cluster, paused, rig
from worker.observe import metrics
from worker.settings import load_settings
from worker.streams.replier import REPLY_AND_ACK, Reply
from worker.streams.shard_replies import PUSH_ONCE, ShardedReplier
from worker.streams.sharding import sharded_parts
from worker.streams.shards import tagged, untagged

__all__ = ["cluster", "rig"]  # the fixtures, imported for pytest
SHARDS = 6
CONSUMER = "c"


def sharded_replier(client: Any, url: str, wait_ms: int) -> ShardedReplier:
    """The worker's own replier (sharding.sharded_parts), WAITing for one replica."""
    settings = load_settings(None, redis_url=url, redis_cluster=True, model="echo",
                             shards=SHARDS, consumer=CONSUMER, replicas_to_wait=1,
                             replicas_wait_ms=wait_ms)
    replier = sharded_parts(settings, client, dict)["replier"]
    assert isinstance(replier, ShardedReplier)
    return replier


def pending_everywhere(client: Any, foreign_key: str | None = None) -> list[Reply]:
    """Two entries per shard, read by CONSUMER; a reply for each, to its shard's default
    reply key (the second of each shard to `foreign_key`, in some other slot, if given)."""
    replies = []
    for shard in range(SHARDS):
        stream = shard_stream_key("redbatch", "echo", shard)
        client.xgroup_create(stream, "workers", id="0", mkstream=True)
        for n in range(2):
            client.xadd(stream, {"n": n})
        [[_, entries]] = client.xreadgroup("workers", CONSUMER, {stream: ">"})
        for n, (entry_id, _) in enumerate(entries):
            raw = entry_id.decode()
            key = shard_reply_key("redbatch", "echo", shard, f"req-{shard}-{n}")
            replies.append(Reply(tagged(raw, shard), foreign_key if n and foreign_key else key,
                                 f"{shard}:{raw}".encode()))
    return replies


def pending(client: Any, shard: int) -> int:
    stream = shard_stream_key("redbatch", "echo", shard)
    return int(client.xpending(stream, "workers")["pending"])


def short_waits() -> float:
    return float(metrics.REPLICATION_SHORT.labels("echo")._value.get())


def waits_blocked(master: redis.Redis) -> int:
    """Clients blocked in WAIT on this master, at one instant (one CLIENT LIST)."""
    return sum(1 for c in master.client_list()
               if c.get("cmd") == "wait" and "b" in c.get("flags", ""))


def test_every_shards_writes_and_waits_run_at_once(rig: ClusterRig) -> None:
    """With every replica stopped (SIGSTOP), each of the 12 WAITs (per shard: the push to
    a shared foreign reply_to, then the reply-and-ack) comes back short. They run at once:
    one CLIENT LIST of the shared key's master finds the WAITs of all six shards' pushes
    blocked at the same time. Written one shard after another, no more than one WAIT could
    ever be blocked."""
    client = connection.sync_client(rig.url(), cluster=True)
    replier = sharded_replier(client, rig.url(), wait_ms=500)
    shared = "redbatch:reply:shared-elsewhere"
    replies = pending_everywhere(client, shared)
    masters = [master.client() for master in rig.masters()]
    for master in masters:  # as on a worker that has written before (no NOSCRIPT)
        master.script_load(PUSH_ONCE)
        master.script_load(REPLY_AND_ACK)
    assert [waits_blocked(master) for master in masters] == [0] * len(masters)
    before = short_waits()
    most = 0  # the most WAITs one master had blocked at one instant
    with ThreadPoolExecutor(1) as pool:
        with paused(*rig.replicas()):  # until send_available returned: every WAIT short
            sending = pool.submit(replier.send_available, replies)
            hang_guard = time.monotonic() + 30
            while not sending.done() and time.monotonic() < hang_guard:
                most = max(most, *(waits_blocked(master) for master in masters))
            sent = sending.result(timeout=1)
    for master in masters:
        master.close()
    assert sent == ([], [])
    assert most == SHARDS  # every shard's push blocked in its WAIT at once
    assert short_waits() - before == 2 * SHARDS  # each WAIT short, and counted
    for reply in replies:
        if reply.reply_key != shared:
            assert client.lrange(reply.reply_key, 0, -1) == [reply.envelope]
    assert sorted(client.lrange(shared, 0, -1)) == sorted(
        r.envelope for r in replies if r.reply_key == shared)  # one push each
    assert [pending(client, s) for s in range(SHARDS)] == [0] * SHARDS
    client.close()


def migrating(rig: ClusterRig, shard: int) -> Any:
    """A context manager: the shard's slot MIGRATING (to another master) in the block."""
    from contextlib import contextmanager

    @contextmanager
    def block() -> Any:
        stream = shard_stream_key("redbatch", "echo", shard)
        source = rig.master_of(stream)
        target = next(m for m in rig.masters() if m.port != source.port)
        with target.client() as other:
            target_id = other.execute_command("CLUSTER", "MYID").decode()
        slot = key_slot(stream)
        with source.client() as master:
            master.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            try:
                yield
            finally:
                master.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
    return block()


def test_a_failing_shard_is_deferred_while_the_others_are_answered(rig: ClusterRig) -> None:
    """Shard 0's slot is MIGRATING, so its reply-and-ack script (its stream there, its
    reply keys not) gets TRYAGAIN while the other five shards, written at the same time,
    are answered and acked. Shard 0's replies are deferred, then answered once due."""
    client = connection.sync_client(rig.url(), cluster=True)
    replier = sharded_replier(client, rig.url(), wait_ms=500)
    replies = pending_everywhere(client)
    with migrating(rig, 0):
        dropped, deferred = replier.send_available(replies)
    shard_0 = [r for r in replies if untagged(r.entry_id)[1] == 0]
    assert dropped == [] and sorted(deferred) == sorted(r.entry_id for r in shard_0)
    for reply in replies:
        answered = client.lrange(reply.reply_key, 0, -1)
        assert answered == ([] if reply in shard_0 else [reply.envelope])
    assert [pending(client, s) for s in range(SHARDS)] == [2, 0, 0, 0, 0, 0]
    assert 0.01 <= replier.next_retry_s() <= 2.0
    time.sleep(replier.next_retry_s())
    assert replier.send_available(shard_0) == ([], [])  # as the reply thread sends them
    for reply in replies:
        assert client.lrange(reply.reply_key, 0, -1) == [reply.envelope]  # one each
    assert [pending(client, s) for s in range(SHARDS)] == [0] * SHARDS
    client.close()


def test_send_raises_a_shards_fault_after_the_others_and_its_retry_writes_only_that_one(
        rig: ClusterRig) -> None:
    """send() writes every shard, then raises shard 0's TRYAGAIN; RedisRetry's retry (the
    same list) writes only shard 0: the others are not reported as dropped."""
    client = connection.sync_client(rig.url(), cluster=True)
    replier = sharded_replier(client, rig.url(), wait_ms=500)
    replies = pending_everywhere(client)
    with migrating(rig, 0), pytest.raises(redis.exceptions.TryAgainError):
        replier.send(replies)
    assert [pending(client, s) for s in range(SHARDS)] == [2, 0, 0, 0, 0, 0]
    assert replier.send(replies) == []
    for reply in replies:
        assert client.lrange(reply.reply_key, 0, -1) == [reply.envelope]
    assert [pending(client, s) for s in range(SHARDS)] == [0] * SHARDS
    client.close()
