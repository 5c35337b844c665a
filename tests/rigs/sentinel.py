"""A Sentinel rig: a master, a replica and three sentinels on real redis-servers, and a plain
replicated pair."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.rigs.servers import RedisNode, TlsFiles, wait_until

SENTINEL_SERVICE = "mymaster"


def replication_up(replica: RedisNode) -> bool:
    with replica.client() as client:
        info = client.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


@dataclass
class SentinelRig:
    """A master, a replica and three sentinels (quorum 2) watching them."""

    master: RedisNode
    replica: RedisNode
    sentinels: list[RedisNode]

    def url(self, db: int = 0) -> str:
        scheme = "rediss+sentinel" if self.master.tls else "redis+sentinel"
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = f"?ssl_ca_certs={self.master.tls.ca}" if self.master.tls else ""
        return f"{scheme}://{hosts}/{SENTINEL_SERVICE}/{db}{query}"

    def nodes(self) -> list[RedisNode]:
        return [self.master, self.replica, *self.sentinels]

    def converged(self) -> bool:
        """Every sentinel knows the master, the replica and the two other sentinels."""
        for node in self.sentinels:
            with node.client() as client:
                if len(client.sentinel_sentinels(SENTINEL_SERVICE)) != 2:
                    return False
                if not client.sentinel_slaves(SENTINEL_SERVICE):
                    return False
        return replication_up(self.replica)

    def master_port(self) -> int:
        with self.sentinels[0].client() as client:
            return int(client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1])

    def master_ports(self) -> set[int]:
        """The master's port as each sentinel names it (one port once they agree)."""
        ports = set()
        for node in self.sentinels:
            with node.client() as client:
                ports.add(int(client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1]))
        return ports


def master_replica(binary: Path, directory: Path,
                   tls: TlsFiles | None = None) -> tuple[RedisNode, RedisNode]:
    """A master and its replica, started, with the replica's first sync done."""
    data = ["appendonly yes", "appendfsync everysec", "save \"\"",
            "maxmemory-policy noeviction", "enable-debug-command local"]  # DEBUG SLEEP
    master = RedisNode(binary, directory / "master", data, tls).start()
    replica = RedisNode(binary, directory / "replica",
                        [*data, f"replicaof 127.0.0.1 {master.port}"], tls).start()
    wait_until(lambda: replication_up(replica), 15, "the replica did not sync")
    return master, replica


@contextmanager
def sentinel_rig(binary: Path, directory: Path, tls: TlsFiles | None = None,
                 sentinel_password: str | None = None) -> Iterator[SentinelRig]:
    """`sentinel_password`: the sentinels' own requirepass (the master has none)."""
    master, replica = master_replica(binary, directory, tls)
    monitor = [f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master.port} 2",
               f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000",
               f"sentinel failover-timeout {SENTINEL_SERVICE} 3000",
               f"sentinel parallel-syncs {SENTINEL_SERVICE} 1"]
    if sentinel_password:  # each sentinel demands it, and gives it to the others
        monitor += [f"requirepass {sentinel_password}",
                    f"sentinel sentinel-pass {sentinel_password}"]
    rig = SentinelRig(master, replica, [
        RedisNode(binary, directory / f"sentinel{i}", monitor, tls, sentinel=True,
                  password=sentinel_password).start()
        for i in range(3)])
    try:
        wait_until(rig.converged, 20, "the sentinels did not find each other")
        yield rig
    finally:
        for node in rig.nodes():
            node.stop()


@contextmanager
def replicated_pair(binary: Path, directory: Path) -> Iterator[tuple[RedisNode, RedisNode]]:
    master, replica = master_replica(binary, directory)
    try:
        yield master, replica
    finally:
        replica.stop()
        master.stop()
