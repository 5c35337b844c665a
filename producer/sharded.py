"""The cluster half of the clients: which shard a request goes to, and where its reply is.

On a Redis Cluster a model's queue is N shards (producer/shards.py). `Sharding` is what both
clients need for that: the round-robin over the shards, a replica count per shard's master,
the reply keys of the requests sent. `ShardedSubmit` is the synchronous client's submit path
over the shards (AsyncClient has its own, without WAIT). On a single Redis `cycle` stays
None and none of this runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from producer import connection, protocol, shards
from producer.backlog import ShardCycle, shard_count, submitted_key
from producer.errors import Overloaded, RedbatchError
from producer.replicas import ReplicaCount

# Cluster mode: default reply keys kept for wait() (producer.client re-exports the name; set
# it here, where it is read).
REMEMBERED_REPLY_KEYS = 100_000


class Sharding:
    """A client's shard state; a base of producer.client._Base, which sets the fields below."""

    namespace: str
    model: str
    stream_key: str
    max_backlog: int | None
    replicas: ReplicaCount

    def __init__(self) -> None:
        self.cycle: ShardCycle | None = None  # on a cluster: the shards, round-robin
        self._shard_replicas: dict[int, ReplicaCount] = {}
        self._reply_keys: dict[str, str] = {}  # on a cluster: request id -> its reply key

    def _shard_over(self, client: Any) -> None:
        """On a cluster, requests go to the model's shards (producer/shards.py)."""
        if connection.is_cluster_client(client):
            shards.check_cluster_names(self.namespace, self.model)
            self.cycle = ShardCycle(shard_count(client, self.namespace, self.model))

    def _replicas_of(self, shard: int | None) -> ReplicaCount:
        """One ReplicaCount per shard on a cluster (each shard's master has its own)."""
        if shard is None:
            return self.replicas
        return self._shard_replicas.setdefault(shard, ReplicaCount(
            self.replicas.configured, self.replicas.timeout_ms))

    def _stream_of(self, shard: int | None) -> str:
        if shard is None:
            return self.stream_key
        return shards.shard_stream_key(self.namespace, self.model, shard)

    def _markers(self, ids: Sequence[str], shard: int | None) -> list[str]:
        """ADD_ONCE's request markers (producer/backlog.py); on a cluster in the shard's slot."""
        if shard is None:
            return [submitted_key(self.namespace, i) for i in ids]
        return [shards.shard_submitted_key(self.namespace, self.model, shard, i) for i in ids]

    def _limit(self) -> int | None:
        """max_backlog, or on a cluster one shard's share of it."""
        if self.cycle is None or self.max_backlog is None:
            return self.max_backlog
        return self.cycle.share(self.max_backlog)

    def _remember(self, ids: Sequence[str], shard: int) -> None:
        """The default reply keys of requests sent to `shard`, for wait()."""
        for request_id in ids:
            self._reply_keys[request_id] = shards.shard_reply_key(
                self.namespace, self.model, shard, request_id)
        while len(self._reply_keys) > REMEMBERED_REPLY_KEYS:
            del self._reply_keys[next(iter(self._reply_keys))]

    def reply_key(self, request_id: str) -> str:
        """The default reply key; on a cluster it names the shard the request went to,
        known for requests this client submitted (else pass wait() the reply_to)."""
        if self.cycle is None:
            return protocol.reply_key(self.namespace, request_id)
        try:
            return self._reply_keys[request_id]
        except KeyError:
            raise RedbatchError(f"request {request_id} was not submitted by this client: on a "
                                "Redis Cluster its reply key names its shard; pass reply_to"
                                ) from None

    def token_stream_key(self, request_id: str) -> str:
        """Where a generative model streams this request's answer when it named no
        `reply_to` (on a cluster, in its shard's slot; see reply_key)."""
        return protocol.token_stream_key(self.namespace, request_id, self.reply_key(request_id))

    def _forget(self, request_id: str) -> None:
        self._reply_keys.pop(request_id, None)


class ShardedSubmit(Sharding):
    """Client's submit path on a cluster; a base of producer.client.Client, which has the
    connection, the scripts and the single-stream writes named below."""

    redis: Any
    _add_if_under: Any  # the registered ADD_IF_UNDER script
    _add_replicated: Callable[..., None]
    _accepted: Callable[..., None]
    _add_arguments: Callable[[list[Any]], list[Any]]
    _chunks: Callable[..., Iterator[tuple[list[str], list[Any]]]]

    def _submit_many_sharded(self, payloads: Sequence[Any], reply_to: str | None,
                             deadline_ms: int | None, priority: int) -> list[str]:
        """Client.submit_many on a cluster: each chunk spread over the shards."""
        ids: list[str] = []
        for chunk_ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority):
            self._submit_sharded(chunk_ids, entries, reply_to is None, ids)
            ids += chunk_ids
        return ids

    def _submit_sharded(self, ids: Sequence[str], entries: list[Any], default_reply: bool,
                        submitted: Sequence[str] = ()) -> None:
        """Cluster: the requests spread over the shards round-robin; a shard over its share
        of max_backlog passes its part on to the next shard, Overloaded when all are."""
        assert self.cycle is not None
        for shard, indices in self.cycle.spread(len(ids)).items():
            group_ids = [ids[i] for i in indices]
            placed = self._to_some_shard(shard, group_ids, [entries[i] for i in indices],
                                         submitted)
            if default_reply:
                self._remember(group_ids, placed)
            submitted = [*submitted, *group_ids]

    def _to_some_shard(self, shard: int, ids: list[str], entries: list[Any],
                       submitted: Sequence[str]) -> int:
        """The shard that took the requests: `shard`, or the next with room."""
        assert self.cycle is not None
        backlog = 0
        for candidate in self.cycle.after(shard):
            try:
                self._to_shard(candidate, ids, entries, submitted)
                return candidate
            except Overloaded as exc:
                backlog = exc.backlog
        assert self.max_backlog is not None
        raise Overloaded(backlog, self.max_backlog, submitted)

    def _to_shard(self, shard: int, ids: list[str], entries: list[Any],
                  submitted: Sequence[str]) -> None:
        stream = self._stream_of(shard)
        replicas = self._replicas_of(shard)
        if wanted := replicas.count(connection.node_client(self.redis, stream)):
            self._add_replicated(ids, entries, wanted, submitted, shard)
        elif self.max_backlog is None:
            pipe = self.redis.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(stream, fields)
            pipe.execute()
        else:
            self._accepted(self._add_if_under(keys=[stream], args=self._add_arguments(entries)),
                           submitted)
