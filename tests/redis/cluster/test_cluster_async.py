"""AsyncClient on a real Redis Cluster (tests/rigs/cluster.py): ADD_ONCE + WAIT on the
connection of the shard's master, short WAITs resubmitted without adding anything twice."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from producer import AsyncClient, Client
from producer.backlog import ShardCycle
from producer.shards import shard_stream_key
from tests.rigs.cluster import ClusterRig, cluster, cluster_worker, flush, paused
from tests.rigs.servers import wait_until

__all__ = ["cluster"]  # the fixture, imported for pytest


def test_async_client_waits_on_the_writes_node_and_resubmits_short_waits(
        cluster: ClusterRig) -> None:
    """As test_cluster's test of Client: the replica of shard 0's master stopped (SIGSTOP),
    shard 0's WAIT comes back short and the same ids are sent again; the other shards' are
    met (a long WAIT timeout, which returns as soon as the replica acknowledges). The
    replica is continued (SIGCONT) once shard 0's write was resubmitted and that came back
    short too."""
    wait_until(cluster.healthy, 20, "the cluster is not healthy")
    flush(cluster)
    url = cluster.url()
    stream = shard_stream_key("redbatch", "echo", 0)
    replica = cluster.replica_of(cluster.master_of(stream))
    sync = Client(url, "echo", cluster=True)
    reply_to = sync.new_reply_key()

    async def submit() -> tuple[list[str], int, int]:
        met = AsyncClient(url, "echo", cluster=True, replicas_to_wait=1, replicas_wait_ms=5000)
        client = AsyncClient(url, "echo", cluster=True, replicas_to_wait=1,
                             replicas_wait_ms=50)
        try:
            await met._discover()
            met.cycle = ShardCycle(6, start=1)
            ids = await met.submit_many([{"n": n} for n in range(5)], reply_to=reply_to)
            await client._discover()
            client.cycle = ShardCycle(6, start=0)  # shard 0 first, then 1..5
            with paused(replica):
                sending = asyncio.ensure_future(client.submit_many(
                    [{"n": n} for n in range(5, 11)], reply_to=reply_to))
                hang_guard = time.monotonic() + 30
                while client.short_waits < 2 and not sending.done() \
                        and time.monotonic() < hang_guard:
                    await asyncio.sleep(0.01)
                resubmitted_short = client.short_waits  # shard 0's, before it could be met
            ids += await asyncio.wait_for(sending, 60)
            return ids, met.short_waits, resubmitted_short
        finally:
            await met.close()
            await client.close()

    with cluster_worker(url, replicas_to_wait=1, replicas_wait_ms=50):
        ids, met, short = asyncio.run(submit())
        assert met == 0 and short >= 2, (met, short)  # shards 1-5 met; 0 short, resubmitted
        envelopes = sync.collect(reply_to, len(ids), timeout=30)  # returns once all came
    assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each
    assert sync.redis.llen(reply_to) == 0  # none twice: the worker stopped, none came late
    assert sync.redis.xinfo_stream(stream)["entries-added"] == 1  # not resubmitted twice
    sync.close()
