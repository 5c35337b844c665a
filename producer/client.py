"""The Python client: enqueue requests on a model's stream and wait for their replies.

`Client` is synchronous and `AsyncClient` (producer/async_client.py, re-exported here) its
asyncio twin; both speak protocol v1 with plain Redis commands (XADD to submit, BLPOP on the
reply key to wait). Their errors are in producer/errors.py, the Redis Cluster path (shards,
round-robin, per-shard reply keys) in producer/sharded.py; all are re-exported here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import redis

from producer import connection, protocol
from producer.backlog import ADD_IF_UNDER, ADD_ONCE, add_arguments, add_once_arguments
from producer.embeddings import with_embedding
from producer.errors import (  # noqa: F401 (re-exported: callers import them from here)
    Overloaded,
    RedbatchError,
    RequestFailed,
    ResultTimeout,
    unwrap,
)
from producer.replicas import AUTO, ReplicaCount
from producer.sharded import REMEMBERED_REPLY_KEYS, ShardedSubmit, Sharding  # noqa: F401

DEFAULT_URL = "redis://localhost:6379/0"
PIPELINE_CHUNK = 1000
# Each BLPOP blocks at most this long, well inside the client's socket timeout (redis-py 8
# defaults to 5 s and raises TimeoutError on a longer block); longer waits take several.
MAX_BLOCK_S = 1.0
MIN_BLOCK_S = 0.01  # BLPOP with a timeout that rounds to 0 would block forever
# A write that a WAIT reports short of replicas, or whose connection broke, is sent again
# this many times (ADD_ONCE makes that idempotent), waiting RESUBMIT_DELAY_S x 2^attempt.
RESUBMITS = 6
RESUBMIT_DELAY_S = 0.1
RESUBMIT_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
                   redis.exceptions.MovedError, redis.exceptions.ClusterDownError,
                   redis.exceptions.TryAgainError)  # the last three: a cluster's failover
MARKER_TTL_MS = 3_600_000


def new_request_id() -> str:
    return uuid.uuid4().hex


def block_slices(timeout: float) -> Iterator[float]:
    """BLPOP timeouts that together wait `timeout` seconds; always at least one."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        yield min(max(remaining, MIN_BLOCK_S), MAX_BLOCK_S)
        if remaining <= MAX_BLOCK_S:
            return


class _Base(Sharding):
    """What both clients share: request fields, chunks, back-pressure, replica checks."""

    def __init__(self, model: str, namespace: str, content_type: str,
                 max_backlog: int | None, group: str,
                 replicas: ReplicaCount | None = None) -> None:
        super().__init__()
        if content_type not in protocol.CONTENT_TYPES:
            raise ValueError(f"content_type must be one of {protocol.CONTENT_TYPES}")
        if max_backlog is not None and max_backlog < 1:
            raise ValueError("max_backlog must be at least 1")
        self.model = model
        self.namespace = namespace
        self.content_type = content_type
        self.stream = protocol.stream_key(namespace, model)
        self.max_backlog = max_backlog
        self.group = group
        # WAIT after each write for this many replicas (producer/replicas.py)
        self.replicas = replicas or ReplicaCount(0)
        self.short_waits = 0  # writes a WAIT reported short of replicas (each resubmitted)
        self.foreign_envelopes = 0  # replies on our keys that answer no request of ours

    def _own(self, data: bytes, request_ids: Collection[str]) -> dict[str, Any] | None:
        """The envelope when it answers one of `request_ids`; else None, counted: any
        producer can name our reply key as its reply_to, so an envelope's id is checked."""
        envelope = protocol.envelope_for(data, request_ids)
        self.foreign_envelopes += envelope is None
        return envelope

    def _once_call(self, ids: Sequence[str], entries: list[Any],
                   shard: int | None = None) -> tuple[list[str], list[Any]]:
        """(KEYS, ARGV) of ADD_ONCE: the stream and one request marker per entry."""
        return [self._stream_of(shard), *self._markers(ids, shard)], add_once_arguments(
            self.group, self._limit(), MARKER_TTL_MS, entries)

    def _chunks(self, payloads: Sequence[Any], reply_to: str | None, deadline_ms: int | None,
                priority: int) -> Iterator[tuple[list[str], list[Any]]]:
        """(ids, fields) per chunk of at most PIPELINE_CHUNK requests."""
        for start in range(0, len(payloads), PIPELINE_CHUNK):
            chunk = payloads[start:start + PIPELINE_CHUNK]
            ids = [new_request_id() for _ in chunk]
            yield ids, [self._fields(payload, request_id, reply_to, deadline_ms, priority)
                        for payload, request_id in zip(chunk, ids, strict=True)]

    def _replicated(self, result: list[Any], acked: int, wanted: int,
                    submitted: Sequence[str],
                    replicas: ReplicaCount | None = None) -> bool:
        """Whether an ADD_ONCE + WAIT is done: Overloaded if refused; a short WAIT is
        counted and means send again."""
        self._accepted(result, submitted)
        if acked >= wanted:
            return True
        self.short_waits += 1
        (replicas or self.replicas).short()
        return False

    def _add_arguments(self, entries: list[Any]) -> list[Any]:
        limit = self._limit()
        assert limit is not None
        return add_arguments(self.group, limit, entries)

    def _limited_chunks(self, payloads: Sequence[Any], reply_to: str | None,
                        deadline_ms: int | None, priority: int) -> Iterator[tuple[list[str], Any]]:
        """(ids, ADD_IF_UNDER arguments) per chunk: each chunk is added whole or refused."""
        for ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority):
            yield ids, self._add_arguments(entries)

    def _accepted(self, result: list[Any], submitted: Sequence[str] = ()) -> None:
        """Raise Overloaded if ADD_IF_UNDER refused the entries."""
        if not result[0]:
            assert self.max_backlog is not None
            raise Overloaded(int(result[1]), self.max_backlog, submitted)

    def _fields(self, payload: Any, request_id: str, reply_to: str | None,
                deadline_ms: int | None, priority: int) -> Any:
        return protocol.entry_fields(
            request_id, protocol.encode(payload, self.content_type),
            content_type=self.content_type, reply_to=reply_to, deadline_ms=deadline_ms,
            priority=priority)

    def new_reply_key(self) -> str:
        """A fresh shared reply key, for collecting many replies on one list."""
        return protocol.reply_key(self.namespace, f"batch-{new_request_id()}")


class Client(ShardedSubmit, _Base):
    """Synchronous client.

    >>> client = Client("redis://localhost:6379/0", model="minilm")
    >>> client.infer({"text": "hello"})["embedding"][:3]
    """

    def __init__(self, url: str = DEFAULT_URL, model: str = "minilm", *,
                 namespace: str = protocol.DEFAULT_NAMESPACE,
                 content_type: str = protocol.MSGPACK,
                 redis_client: redis.Redis | None = None,
                 max_backlog: int | None = None, group: str = protocol.DEFAULT_GROUP,
                 cluster: bool = False, replicas_to_wait: int = AUTO,
                 replicas_wait_ms: int = 100, as_numpy: bool = False) -> None:
        """`max_backlog`: refuse (Overloaded) when the group's backlog would pass it.
        `url`: any form producer/connection.py reads (Sentinel, TLS; `cluster` for a seed
        node). `replicas_to_wait`: WAIT for that many replicas after each XADD, and send
        again (idempotently) when it comes back short; -1: 1 while the master has one."""
        super().__init__(model, namespace, content_type, max_backlog, group,
                         ReplicaCount(replicas_to_wait, replicas_wait_ms))
        self.redis = redis_client or connection.sync_client(url, cluster)
        self._add_if_under = self.redis.register_script(ADD_IF_UNDER)
        self._add_once = self.redis.register_script(ADD_ONCE)
        self._shard_over(self.redis)
        self.as_numpy = as_numpy  # embeddings (either encoding) as float32 numpy arrays

    def submit(self, payload: Any, *, request_id: str | None = None, reply_to: str | None = None,
               deadline_ms: int | None = None, priority: int = 0) -> str:
        """Enqueue one request; returns its id."""
        request_id = request_id or new_request_id()
        fields = self._fields(payload, request_id, reply_to, deadline_ms, priority)
        if self.cycle is not None:
            self._submit_sharded([request_id], [fields], reply_to is None)
        elif wanted := self.replicas.count(self.redis):
            self._add_replicated([request_id], [fields], wanted)
        elif self.max_backlog is None:
            self.redis.xadd(self.stream, fields)
        else:
            self._accepted(self._add_if_under(keys=[self.stream],
                                              args=self._add_arguments([fields])))
        return request_id

    def submit_many(self, payloads: Iterable[Any], *, reply_to: str | None = None,
                    deadline_ms: int | None = None, priority: int = 0) -> list[str]:
        """Enqueue many requests in pipelined round trips; returns their ids in order."""
        if self.cycle is not None:
            return self._submit_many_sharded(list(payloads), reply_to, deadline_ms, priority)
        if wanted := self.replicas.count(self.redis):
            ids: list[str] = []
            for chunk_ids, entries in self._chunks(list(payloads), reply_to, deadline_ms,
                                                   priority):
                self._add_replicated(chunk_ids, entries, wanted, ids)
                ids += chunk_ids
            return ids
        if self.max_backlog is not None:
            return self._submit_many_under_limit(list(payloads), reply_to, deadline_ms,
                                                 priority)
        ids = []
        pipe = self.redis.pipeline(transaction=False)
        for payload in payloads:
            ids.append(new_request_id())
            pipe.xadd(self.stream, self._fields(payload, ids[-1], reply_to, deadline_ms,
                                                priority))
            if len(pipe) >= PIPELINE_CHUNK:
                pipe.execute()
        pipe.execute()
        return ids

    def _add_replicated(self, ids: Sequence[str], entries: list[Any], wanted: int,
                        submitted: Sequence[str] = (), shard: int | None = None) -> None:
        """ADD_ONCE and WAIT on one connection (a plain pipeline; on a cluster, to the
        shard's master); sent again while the WAIT comes back short or the connection
        breaks (a failover), RESUBMITS times at most. Past that the entries are on the
        master, not known to be on a replica."""
        keys, args = self._once_call(ids, entries, shard)
        replicas = self._replicas_of(shard)
        fault: Exception | None = None
        for attempt in range(RESUBMITS + 1):
            if fault is not None:  # the slot table as it is now, not as at the fault
                connection.follow_cluster(self.redis, fault)
            try:
                node = connection.node_client(self.redis, keys[0])
                pipe = node.pipeline(transaction=False)
                self._add_once(keys=keys, args=args, client=pipe)
                pipe.wait(wanted, replicas.timeout_ms)
                result, acked = pipe.execute()
                if self._replicated(result, acked, wanted, submitted, replicas):
                    return
                if not (wanted := replicas.count(connection.node_client(self.redis, keys[0]))):
                    return  # no replica left to wait for (AUTO, after a failover)
            except redis.exceptions.AskError as exc:
                if isinstance(exc, redis.exceptions.MovedError):
                    if attempt == RESUBMITS:
                        raise
                    fault = exc
                else:  # a slot mid-migration: through the cluster client (ASKING), no WAIT
                    self.short_waits += 1
                    self._accepted(self._add_once(keys=keys, args=args), submitted)
                    return
            except RESUBMIT_ERRORS as exc:
                if attempt == RESUBMITS:
                    raise
                fault = exc
            time.sleep(RESUBMIT_DELAY_S * 2**attempt)

    def _submit_many_under_limit(self, payloads: list[Any], reply_to: str | None,
                                 deadline_ms: int | None, priority: int) -> list[str]:
        ids: list[str] = []
        for chunk_ids, args in self._limited_chunks(payloads, reply_to, deadline_ms, priority):
            self._accepted(self._add_if_under(keys=[self.stream], args=args), ids)
            ids += chunk_ids
        return ids

    def wait(self, request_id: str, timeout: float = 30.0, reply_to: str | None = None,
             as_numpy: bool | None = None) -> dict[str, Any]:
        """Its reply envelope (ok or not), never another id's; ResultTimeout if none came."""
        key = reply_to or self.reply_key(request_id)
        for block_s in block_slices(timeout):
            popped: Any = self.redis.blpop([key], timeout=block_s)
            envelope = popped and self._own(popped[1], (request_id,))
            if envelope:
                self._forget(request_id)
                return with_embedding(envelope, self.as_numpy if as_numpy is None else as_numpy)
        raise ResultTimeout(f"no reply for request {request_id} within {timeout} s")

    def result(self, request_id: str, timeout: float = 30.0,
               as_numpy: bool | None = None) -> Any:
        """The result of one request; RequestFailed or ResultTimeout otherwise."""
        return unwrap(self.wait(request_id, timeout, as_numpy=as_numpy))

    def infer(self, payload: Any, timeout: float = 30.0, as_numpy: bool | None = None,
              **options: Any) -> Any:
        """Submit and wait in one call (`as_numpy`: the embedding as a numpy array)."""
        return self.result(self.submit(payload, **options), timeout, as_numpy)

    def collect(self, reply_to: str, count: int, timeout: float = 60.0,
                on_reply: Any = None, ids: Collection[str] | None = None
                ) -> list[dict[str, Any]]:
        """Pop up to `count` envelopes from a shared reply key, until `timeout` elapses;
        with `ids`, only theirs (others are dropped and counted in foreign_envelopes)."""
        envelopes: list[dict[str, Any]] = []
        for block_s in block_slices(timeout):
            if len(envelopes) >= count:
                break
            popped: Any = self.redis.blpop([reply_to], timeout=block_s)
            if popped is None:
                continue
            more = count - len(envelopes) - 1
            batch = [popped[1], *((self.redis.lpop(reply_to, more) or []) if more else [])]
            for data in batch:
                envelope = protocol.decode_envelope(data) if ids is None else self._own(data, ids)
                if envelope:
                    envelopes.append(with_embedding(envelope, self.as_numpy))
                    if on_reply:
                        on_reply(envelopes[-1])
        return envelopes

    def close(self) -> None:
        self.redis.close()
