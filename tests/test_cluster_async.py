"""AsyncClient on a real Redis Cluster (tests/cluster_rig.py): ADD_ONCE + WAIT on the
connection of the shard's master, short WAITs resubmitted without adding anything twice."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from producer import AsyncClient, Client, protocol
from producer.backlog import ShardCycle
from tests.cluster_rig import ClusterRig, cluster, cluster_worker, flush
from tests.conftest import wait_until

__all__ = ["cluster"]  # the fixture, imported for pytest


def test_async_client_waits_on_the_writes_node_and_resubmits_short_waits(
        cluster: ClusterRig) -> None:
    """As test_cluster's test of Client: the replica of shard 0's master asleep, shard 0's
    WAIT comes back short and the same ids are sent again; the other shards' are met."""
    wait_until(cluster.healthy, 20, "the cluster is not healthy")
    flush(cluster)
    url = cluster.url()
    stream = protocol.shard_stream_key("redbatch", "echo", 0)
    replica = cluster.replica_of(cluster.master_of(stream))
    sync = Client(url, "echo", cluster=True)
    reply_to = sync.new_reply_key()

    async def submit() -> tuple[list[str], int, int]:
        client = AsyncClient(url, "echo", cluster=True, replicas_to_wait=1,
                             replicas_wait_ms=50)
        try:
            await client._discover()
            client.cycle = ShardCycle(6, start=1)
            ids = await client.submit_many([{"n": n} for n in range(5)], reply_to=reply_to)
            met = client.short_waits  # shards 1-5: their replicas answered
            sleeper = replica.client(socket_timeout=10)
            threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", "1.5"),
                             daemon=True).start()
            await asyncio.sleep(0.2)
            ids += await client.submit_many([{"n": n} for n in range(5, 11)],
                                            reply_to=reply_to)
            return ids, met, client.short_waits
        finally:
            await client.close()

    with cluster_worker(url, replicas_to_wait=1, replicas_wait_ms=50):
        started = time.monotonic()
        ids, met, short = asyncio.run(submit())
        assert met == 0 and short >= 1, (met, short)
        assert time.monotonic() - started < 30
        envelopes = sync.collect(reply_to, len(ids) + 3, timeout=4)
    assert Counter(e["id"] for e in envelopes) == Counter(ids)  # one each, none twice
    assert sync.redis.xinfo_stream(stream)["entries-added"] == 1  # not resubmitted twice
    sync.close()
