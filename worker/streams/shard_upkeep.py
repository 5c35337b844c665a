"""Redis Cluster: reclaim, dead letters, trimming and the backlog, per shard.

Each shard has its own Reclaimer and DeadLetters (their scripts keep to the shard's slot);
these wrappers split the pipeline's tagged ids by shard (shards.py) and put the tags back.
Every worker claims for itself (XAUTOCLAIM is atomic, so two claimants never share an
entry). Trimming and the removal of idle consumers need one worker per shard and period:
each takes the shard's lease (`SET <ns>:lease:{<m>:<s>}:upkeep <consumer> NX PX`) first,
and the worker that got it acts; the others skip that shard until the next period.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from worker.observe import metrics
from worker.streams.dead_letters import DeadLetters
from worker.streams.maintenance import BACKLOG_GAUGE_CAP, Maintenance, registry_entry
from worker.streams.reader import Entry
from worker.streams.reclaimer import Reclaimer
from worker.streams.shards import Localiser, tagged, untagged


class ShardedReclaimer:
    """Claims idle entries of dead consumers, shard by shard, where a sweep is due."""

    def __init__(self, reclaimers: Sequence[Reclaimer], localise: Localiser) -> None:
        self.reclaimers = list(reclaimers)
        self.localise = localise
        self.consumer = reclaimers[0].consumer

    def due(self) -> bool:
        return any(r.due() for r in self.reclaimers)

    def claim(self, count: int) -> list[Entry]:
        """Up to `count` idle entries, from the first due shard that has some."""
        for shard, reclaimer in enumerate(self.reclaimers):
            if reclaimer.due():
                claimed = reclaimer.claim(count)
                if claimed:
                    return self.localise(claimed, shard)
        return []

    def remove_idle_consumers(self, idle_ms: int) -> list[str]:
        """On every shard (ShardedMaintenance does it under the shard's lease instead)."""
        return sorted({n for r in self.reclaimers for n in r.remove_idle_consumers(idle_ms)})


class ShardedDeadLetters:
    """Diverts poison entries, each on its own shard's dead-letter stream."""

    def __init__(self, shards: Sequence[DeadLetters], localise: Localiser) -> None:
        self.shards = list(shards)
        self.localise = localise

    def divert(self, entries: Sequence[Entry]) -> list[Entry]:
        """DeadLetters.divert per shard; the entries still to serve, in their order."""
        groups: dict[int, list[Entry]] = {}
        for entry in entries:
            groups.setdefault(untagged(entry.id)[1], []).append(entry)
        kept: set[str] = set()
        for shard, group in groups.items():
            served = self.shards[shard].divert([self.localise.original(e) for e in group])
            kept.update(tagged(e.id, shard) for e in served)
        return [e for e in entries if e.id in kept]


class ShardedMaintenance(Maintenance):
    """Maintenance over every shard: trim and idle consumers under each shard's lease; the
    backlog gauge summed over the shards; one announcement, as on a single Redis."""

    def __init__(self, client: Any, reclaimers: Sequence[Reclaimer], lease_keys: Sequence[str],
                 group: str, model_name: str, interval_s: float, consumer_idle_ms: int,
                 describe: Callable[[], Mapping[str, Any]] | None = None,
                 workers_key: str | None = None, models_key: str | None = None,
                 internal_keys: Mapping[str, str] | None = None) -> None:
        super().__init__(client, reclaimers[0].stream, group, model_name, reclaimers[0],
                         interval_s, consumer_idle_ms, describe, workers_key, models_key,
                         internal_keys)
        self.shards = list(zip([r.stream for r in reclaimers], reclaimers, lease_keys,
                               strict=True))
        self.lease_ms = max(1, int(interval_s * 1000))

    def run_once(self) -> None:
        gone: set[str] = set()
        for stream, reclaimer, lease in self.shards:
            if self.client.set(lease, self.reclaimer.consumer, nx=True, px=self.lease_ms):
                self._trim(keys=[stream])
                gone.update(reclaimer.remove_idle_consumers(self.consumer_idle_ms))
        metrics.BACKLOG.labels(self.model_name).set(self.backlog())
        self.announce(gone=sorted(gone))

    def announce(self, gone: list[str] | None = None) -> None:
        """As Maintenance.announce, but the registry entry in a call of its own, after the
        workers hash's transaction: on a cluster the two keys are in different slots, and a
        transaction keeps to one. A worker that dies in between is seen again at its next
        announcement, or never (then its entry goes stale and the gateway skips it)."""
        if self.workers_key is None:
            return
        described = {**self.describe(), "seen_ms": int(time.time() * 1000)}
        pipe = self.client.pipeline(transaction=True)
        self._describe_in(pipe, described, gone)
        self._tolerating_wrong_types(pipe.execute)
        if self.models_key is not None:
            models_key = self.models_key
            self._tolerating_wrong_types(lambda: self.client.hset(
                models_key, self.model_name, registry_entry(described)))

    def reclaimers(self) -> list[Reclaimer]:
        return [reclaimer for _, reclaimer, _ in self.shards]

    def trim(self) -> int:
        """Every shard, lease or not (for tests and tools)."""
        return sum(int(self._trim(keys=[stream])) for stream, _, _ in self.shards)

    def backlog(self) -> int:
        return sum(int(self._backlog(keys=[stream], args=[self.group, BACKLOG_GAUGE_CAP]))
                   for stream, _, _ in self.shards)

