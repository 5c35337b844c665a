"""The Python client: enqueue requests on a model's stream and wait for their replies.

`Client` is synchronous and `AsyncClient` (producer/async_client.py, re-exported here) its
asyncio twin; both speak protocol v1 with plain Redis commands (XADD to submit, BLPOP on the
reply key to wait). Their errors are in producer/errors.py, the Redis Cluster path (shards,
round-robin, per-shard reply keys) in producer/sharded.py; all are re-exported here.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import redis

from producer import connection, models, protocol, streaming
from producer import request_base as base
from producer.backlog import ADD_IF_UNDER, ADD_ONCE
from producer.embeddings import with_embedding
from producer.errors import ResultTimeout, unwrap
from producer.replicas import AUTO, ReplicaCount
from producer.request_base import DEFAULT_URL, _Base, block_slices, new_request_id
from producer.sharded import REMEMBERED_REPLY_KEYS, ShardedSubmit  # noqa: F401


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
        models.learn_kind(self.redis, self.kind, self.namespace, self.model)
        fields = self._fields(payload, request_id, reply_to, deadline_ms, priority)
        if self.cycle is not None:
            self._submit_sharded([request_id], [fields], reply_to is None)
        elif wanted := self.replicas.count(self.redis):
            self._add_replicated([request_id], [fields], wanted)
        elif self.max_backlog is None:
            self.redis.xadd(self.stream_key, fields)
        else:
            self._accepted(self._add_if_under(keys=[self.stream_key],
                                              args=self._add_arguments([fields])))
        return request_id

    def submit_many(self, payloads: Iterable[Any], *, reply_to: str | None = None,
                    deadline_ms: int | None = None, priority: int = 0,
                    request_ids: Sequence[str] | None = None) -> list[str]:
        """Enqueue many requests in pipelined round trips; returns their ids in order
        (`request_ids`, one per payload, else new ones)."""
        models.learn_kind(self.redis, self.kind, self.namespace, self.model)
        if request_ids is not None:
            payloads = list(payloads)
            if len(request_ids) != len(payloads):
                raise ValueError("request_ids must have one id per payload")
            return self._submit_many_ids(payloads, request_ids, reply_to, deadline_ms, priority)
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
            pipe.xadd(self.stream_key, self._fields(payload, ids[-1], reply_to, deadline_ms,
                                                priority))
            if len(pipe) >= base.PIPELINE_CHUNK:
                pipe.execute()
        pipe.execute()
        return ids

    def _submit_many_ids(self, payloads: list[Any], request_ids: Sequence[str],
                         reply_to: str | None, deadline_ms: int | None,
                         priority: int) -> list[str]:
        """submit_many with the caller's ids: a submit each on a cluster or with replicas,
        else ADD_IF_UNDER per chunk (max_backlog) or one pipeline per chunk."""
        if self.cycle is not None or self.replicas.count(self.redis):
            return [self.submit(payload, request_id=request_id, reply_to=reply_to,
                                deadline_ms=deadline_ms, priority=priority)
                    for payload, request_id in zip(payloads, request_ids, strict=True)]
        ids: list[str] = []
        if self.max_backlog is not None:
            for chunk_ids, args in self._limited_chunks(payloads, reply_to, deadline_ms,
                                                        priority, request_ids):
                self._accepted(self._add_if_under(keys=[self.stream_key], args=args), ids)
                ids += chunk_ids
            return ids
        for chunk_ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority,
                                               request_ids):
            pipe = self.redis.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(self.stream_key, fields)
            pipe.execute()
            ids += chunk_ids
        return ids

    def _add_replicated(self, ids: Sequence[str], entries: list[Any], wanted: int,
                        submitted: Sequence[str] = (), shard: int | None = None) -> None:
        """ADD_ONCE and WAIT on one connection (a plain pipeline; on a cluster, to the
        shard's master); sent again while the WAIT comes back short or the connection
        breaks (a failover), base.RESUBMITS times at most. Past that the entries are on the
        master, not known to be on a replica."""
        keys, args = self._once_call(ids, entries, shard)
        replicas = self._replicas_of(shard)
        fault: Exception | None = None
        for attempt in range(base.RESUBMITS + 1):
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
                    if attempt == base.RESUBMITS:
                        raise
                    fault = exc
                else:  # a slot mid-migration: through the cluster client (ASKING), no WAIT
                    self.short_waits += 1
                    self._accepted(self._add_once(keys=keys, args=args), submitted)
                    return
            except base.RESUBMIT_ERRORS as exc:
                if attempt == base.RESUBMITS:
                    raise
                fault = exc
            time.sleep(base.RESUBMIT_DELAY_S * 2**attempt)

    def _submit_many_under_limit(self, payloads: list[Any], reply_to: str | None,
                                 deadline_ms: int | None, priority: int) -> list[str]:
        ids: list[str] = []
        for chunk_ids, args in self._limited_chunks(payloads, reply_to, deadline_ms, priority):
            self._accepted(self._add_if_under(keys=[self.stream_key], args=args), ids)
            ids += chunk_ids
        return ids

    def wait(self, request_id: str, timeout: float = 30.0, reply_to: str | None = None,
             as_numpy: bool | None = None) -> dict[str, Any]:
        """Its reply envelope (ok or not), never another id's; ResultTimeout if none came.
        A request sent with `"stream": true` to a generative model: its `done` envelope."""
        if request_id in self._streamed:
            reading = streaming.StreamReading(request_id)
            key = self.token_stream(request_id, reply_to)
            for _ in streaming.read_stream(self.redis, key, reading, block_slices(timeout)):
                pass
            self._streamed.pop(request_id, None)
            assert reading.done is not None
            return {**reading.done, "ok": bool(reading.done.get("ok"))}
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

    def stream(self, payload: Any, timeout: float = 60.0, **options: Any
               ) -> Iterator[str | Any]:
        """Submit a generative request and yield its answer's text as it comes (str), then
        its final result (the `done` entry's, a dict); RequestFailed if it failed. Survives
        a broken connection (reads on from the last entry id)."""
        request_id = self.submit(streaming.streamed_payload(payload), **options)
        self._streamed.pop(request_id, None)
        reading = streaming.StreamReading(request_id)
        key = self.token_stream(request_id, options.get("reply_to"))
        yield from streaming.read_stream(self.redis, key, reading, block_slices(timeout))
        self.foreign_envelopes += reading.foreign
        self._forget(request_id)
        yield reading.final()

    def models(self, idle_s: float = models.DEFAULT_IDLE_S) -> dict[str, models.LiveModel]:
        """The models with a live worker (one seen within `idle_s`), by name, with their
        kind (`generative`), as the gateway's /v1/models lists them."""
        return models.live_models(self.redis, self.namespace, idle_s)

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
