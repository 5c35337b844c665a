"""A real Redis Cluster for tests: 3 masters + 3 replicas of Debian's Redis 7 (conftest's
`redis7`: skipped without it, or without redis-cli), and workers that serve it.

`cluster_rig` starts six `cluster-enabled` nodes with AOF, joins them with `redis-cli
--cluster create --cluster-replicas 1`, and waits until every node reports `cluster_state:ok`
and every replica `master_link_status:up`, so no fault is injected before replication runs.
`cluster-node-timeout` is short (1 s), so a killed master's replica takes over in ~2 s.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.rigs.servers import RedisNode, wait_until
from tests.rigs.workers import running_worker
from worker.pipeline.worker import Worker

NODE_TIMEOUT_MS = 1000
NODE_LINES = ["cluster-enabled yes", f"cluster-node-timeout {NODE_TIMEOUT_MS}",
              "cluster-require-full-coverage no", "cluster-replica-validity-factor 0",
              "appendonly yes", "appendfsync everysec", "save \"\"",
              "maxmemory-policy noeviction", "enable-debug-command local"]  # DEBUG SLEEP


@dataclass
class ClusterRig:
    nodes: list[RedisNode]

    def url(self) -> str:
        """A seed node's URL (any live node will do)."""
        return f"redis://127.0.0.1:{self.live()[0].port}/0"

    def live(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.process and n.process.poll() is None]

    def role(self, node: RedisNode) -> str:
        with node.client() as client:
            return str(client.info("replication")["role"])

    def masters(self) -> list[RedisNode]:
        return [n for n in self.live() if self.role(n) == "master"]

    def replicas(self) -> list[RedisNode]:
        return [n for n in self.live() if self.role(n) == "slave"]

    def healthy(self, masters: int = 3) -> bool:
        """Every live node sees the cluster ok; `masters` masters, each replica linked up."""
        try:
            for node in self.live():
                with node.client() as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
            if len(self.masters()) != masters:
                return False
            for replica in self.replicas():
                with replica.client() as client:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
        except redis.RedisError:
            return False
        return True

    def replica_of(self, master: RedisNode) -> RedisNode:
        """The master's replica, waiting for the master to list it (its link may be up on the
        replica's side a moment before the master's INFO shows it)."""
        def listed() -> int | None:
            with master.client() as client:
                replica = client.info("replication").get("slave0")
            return int(replica["port"]) if replica else None

        wait_until(lambda: listed() is not None, 15, "the master did not list its replica")
        return next(n for n in self.nodes if n.port == listed())

    def master_of(self, key: str) -> RedisNode:
        with redis.RedisCluster.from_url(self.url()) as client:
            port = client.get_node_from_key(key).port
        return next(n for n in self.nodes if n.port == port)


@contextmanager
def cluster_rig(binary: Path, directory: Path) -> Iterator[ClusterRig]:
    if not shutil.which("redis-cli"):
        pytest.skip("needs redis-cli")
    nodes = [RedisNode(binary, directory / f"node{i}",
                       [*NODE_LINES, f"cluster-config-file {directory / f'node{i}'}/nodes.conf"])
             for i in range(6)]
    rig = ClusterRig(nodes)
    try:
        for node in nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_until(rig.healthy, 30, "the cluster did not come up with its replicas")
        yield rig
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def cluster(redis7: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterRig]:
    """A cluster shared by a module's tests (a test that kills a master uses its own)."""
    with cluster_rig(redis7, tmp_path_factory.mktemp("cluster")) as rig:
        yield rig


@pytest.fixture
def rig(cluster: ClusterRig) -> ClusterRig:
    """The module's cluster, healthy and emptied: what each test starts from."""
    wait_until(cluster.healthy, 20, "the cluster is not healthy")
    flush(cluster)
    return cluster


def cluster_worker(url: str, model: str = "echo",
                   **overrides: Any) -> AbstractContextManager[Worker]:
    """conftest.running_worker, on a cluster (redis_cluster, the cluster client)."""
    return running_worker(url, model, overrides.pop("model_options", None),
                          redis_cluster=True, **overrides)


def flush(rig: ClusterRig) -> None:
    """Empty every master (between tests sharing a rig)."""
    for node in rig.masters():
        with node.client() as client:
            client.flushall()


@contextmanager
def paused(*nodes: RedisNode) -> Iterator[None]:
    """The nodes' redis-server processes stopped (SIGSTOP) for the block, continued
    (SIGCONT) in a `finally`. A stopped replica acknowledges nothing for as long as the block
    lasts, whatever the host's scheduling: unlike a DEBUG SLEEP sent from a thread, it needs
    no head start and does not end on a timer. The block starts once the kernel reports
    every process stopped. Keep blocks on a cluster short of what the test can tolerate:
    past cluster-node-timeout the other nodes flag a stopped node as failing (it rejoins
    when continued)."""
    stopped: list[subprocess.Popen[bytes]] = []
    try:
        for node in nodes:
            assert node.process is not None and node.process.poll() is None, node.dir
            node.process.send_signal(signal.SIGSTOP)
            stopped.append(node.process)
        if Path("/proc").is_dir():
            wait_until(lambda: all(_state(p.pid) == "T" for p in stopped), 10,
                       "a paused redis-server did not stop")
        yield
    finally:
        for process in stopped:
            process.send_signal(signal.SIGCONT)


def _state(pid: int) -> str:
    """The process's state letter in /proc/<pid>/stat (T: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]
