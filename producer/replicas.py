"""How many replicas a WAIT after each write asks for (`replicas_to_wait`).

Shared by the producer and the worker; it only reads INFO through the client it is given.
"""

from __future__ import annotations

import time
from typing import Any

from producer.connection import is_cluster_client

AUTO = -1  # replicas_to_wait: 1 when the master has a connected replica, else 0
AUTO_REFRESH_S = 30.0


def connected_replicas(info: dict[str, Any]) -> int:
    """`INFO replication`'s count of replicas connected to this master (0 on a replica)."""
    if info.get("role") != "master":
        return 0
    return int(info.get("connected_slaves", 0))


class ReplicaCount:
    """How many replicas a WAIT after each write asks for: the setting, or with AUTO one
    while the master has a connected replica (read again every AUTO_REFRESH_S and after a
    short WAIT, so a failover to a master without replicas stops waiting). On a cluster,
    count() takes the node client of the write's slot (node_client), one ReplicaCount per
    shard; given the cluster client itself it answers 0."""

    def __init__(self, configured: int, timeout_ms: int = 100) -> None:
        self.configured = configured
        self.timeout_ms = timeout_ms
        self._auto = 0
        self._read_at = -float("inf")

    def needs_reading(self) -> bool:
        return self.configured == AUTO and time.monotonic() - self._read_at > AUTO_REFRESH_S

    def update(self, info: dict[str, Any]) -> None:
        self._auto = min(1, connected_replicas(info))
        self._read_at = time.monotonic()

    def short(self) -> None:
        """A WAIT came back short: with AUTO, read the master's replicas again next time
        (after a failover the new master may have none left to wait for)."""
        self._read_at = -float("inf")

    def current(self) -> int:
        return self._auto if self.configured == AUTO else self.configured

    def count(self, client: Any) -> int:
        """The count now, reading the master's INFO when AUTO is due (sync clients)."""
        if is_cluster_client(client):
            return 0
        if self.needs_reading():
            self.update(client.info("replication"))
        return self.current()
