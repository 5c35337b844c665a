"""The asyncio client: `AsyncClient`, with the same calls as `producer.client.Client`.

Re-exported from producer.client and producer; the shared pieces (request fields, chunks,
back-pressure and replica checks) live on `producer.client._Base`, the shard state on its
base `producer.sharded.Sharding`. Module constants are read through `base` at call time, as
Client reads them, so setting one (e.g. PIPELINE_CHUNK) on producer.client applies to both
clients (REMEMBERED_REPLY_KEYS is producer.sharded's, where it is used).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

import producer.request_base as base
from producer import connection, models, protocol, streaming
from producer.backlog import ADD_IF_UNDER, ADD_ONCE, ShardCycle, published_shards
from producer.embeddings import with_embedding
from producer.errors import Overloaded, ResultTimeout, unwrap
from producer.replicas import AUTO, ReplicaCount
from producer.shards import check_cluster_names, default_shards, shards_key


class AsyncClient(base._Base):
    """asyncio client with the same calls as Client."""

    def __init__(self, url: str = base.DEFAULT_URL, model: str = "minilm", *,
                 namespace: str = protocol.DEFAULT_NAMESPACE,
                 content_type: str = protocol.MSGPACK,
                 redis_client: aioredis.Redis | None = None,
                 max_backlog: int | None = None, group: str = protocol.DEFAULT_GROUP,
                 cluster: bool = False, replicas_to_wait: int = AUTO,
                 replicas_wait_ms: int = 100, as_numpy: bool = False) -> None:
        super().__init__(model, namespace, content_type, max_backlog, group,
                         ReplicaCount(replicas_to_wait, replicas_wait_ms))
        self.as_numpy = as_numpy  # embeddings (either encoding) as float32 numpy arrays
        self.redis = redis_client or connection.async_client(url, cluster)
        self._add_if_under = self.redis.register_script(ADD_IF_UNDER)
        self._add_once = self.redis.register_script(ADD_ONCE)
        self._discovered = not connection.is_cluster_client(self.redis)
        self._discovering = asyncio.Lock()
        self._nodes: dict[str, aioredis.Redis] = {}  # on a cluster: a client per master

    async def _discover(self) -> None:
        """On a cluster, the model's shard count (producer.backlog.shard_count), once; the
        first call only (concurrent first calls wait for it, and the cluster's slot table)."""
        if self._discovered:
            return
        async with self._discovering:
            if not self._discovered:
                await self.redis.initialize()
                await self._read_shards()

    async def _read_shards(self) -> None:
        check_cluster_names(self.namespace, self.model)
        key = shards_key(self.namespace, self.model)
        count = published_shards(await self.redis.get(key))
        if count is None:
            await self.redis.set(key, default_shards(connection.master_count(self.redis)),
                                 nx=True)
            count = published_shards(await self.redis.get(key))
        if count is None:
            raise ValueError(f"{key} does not hold a shard count")
        self.cycle, self._discovered = ShardCycle(count), True

    async def _submit_sharded(self, ids: Sequence[str], entries: list[Any],
                              default_reply: bool, submitted: Sequence[str] = ()) -> None:
        """Client._submit_sharded for asyncio: each shard's part with ADD_ONCE + WAIT on
        its master's connection when it has replicas, else pipelined, or through
        ADD_IF_UNDER moving on past a full shard."""
        assert self.cycle is not None
        for shard, indices in self.cycle.spread(len(ids)).items():
            group_ids, group = [ids[i] for i in indices], [entries[i] for i in indices]
            placed = await self._to_some_shard(shard, group_ids, group, submitted)
            if default_reply:
                self._remember(group_ids, placed)
            submitted = [*submitted, *group_ids]

    async def _to_some_shard(self, shard: int, group_ids: list[str], entries: list[Any],
                             submitted: Sequence[str]) -> int:
        assert self.cycle is not None
        backlog = 0
        for candidate in self.cycle.after(shard):
            stream = self._stream_of(candidate)
            if wanted := await self._wanted_on(candidate):
                try:
                    await self._add_replicated(group_ids, entries, wanted, submitted,
                                               candidate)
                    return candidate
                except Overloaded as exc:
                    backlog = exc.backlog
                    continue
            if self.max_backlog is None:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for fields in entries:
                        pipe.xadd(stream, fields)
                    await pipe.execute()
                return candidate
            result = await self._add_if_under(keys=[stream], args=self._add_arguments(entries))
            if result[0]:
                return candidate
            backlog = int(result[1])
        assert self.max_backlog is not None
        raise Overloaded(backlog, self.max_backlog, submitted)

    async def _wanted(self) -> int:
        return 0 if connection.is_cluster_client(self.redis) else await self._wanted_on(None)

    async def _wanted_on(self, shard: int | None) -> int:
        """The replicas to wait for: the master's (on a cluster, the shard's master's)."""
        replicas = self._replicas_of(shard)
        if replicas.needs_reading():
            node = self._node(self._stream_of(shard))
            replicas.update(await node.info("replication"))
        return replicas.current()

    def _node(self, key: str) -> Any:
        """The client itself, or on a cluster a client of the master of `key`'s slot: a
        write and its WAIT go on one connection (connection.node_client, for asyncio; its
        ClusterNodes have no client of their own)."""
        if not connection.is_cluster_client(self.redis):
            return self.redis
        cluster: Any = self.redis
        node = cluster.get_node_from_key(key)
        if node.name not in self._nodes:
            kwargs = {**node.connection_kwargs, "host": node.host, "port": node.port}
            pool = aioredis.ConnectionPool(connection_class=node.connection_class, **kwargs)
            self._nodes[node.name] = aioredis.Redis(connection_pool=pool)
        return self._nodes[node.name]

    async def _add_replicated(self, ids: Sequence[str], entries: list[Any], wanted: int,
                              submitted: Sequence[str] = (), shard: int | None = None) -> None:
        """Client._add_replicated for asyncio."""
        keys, args = self._once_call(ids, entries, shard)
        replicas = self._replicas_of(shard)
        fault: Exception | None = None
        for attempt in range(base.RESUBMITS + 1):
            if fault is not None:  # the slot table as it is now, not as at the fault
                await connection.follow_cluster_async(self.redis, fault)
            try:
                async with self._node(keys[0]).pipeline(transaction=False) as pipe:
                    await self._add_once(keys=keys, args=args, client=pipe)
                    pipe.wait(wanted, replicas.timeout_ms)
                    result, acked = await pipe.execute()
                if self._replicated(result, acked, wanted, submitted, replicas):
                    return
                if not (wanted := await self._wanted_on(shard)):
                    return
            except redis.exceptions.AskError as exc:
                if not isinstance(exc, redis.exceptions.MovedError):  # mid-migration
                    self.short_waits += 1  # through the cluster client (ASKING), no WAIT
                    self._accepted(await self._add_once(keys=keys, args=args), submitted)
                    return
                if attempt == base.RESUBMITS:
                    raise
                fault = exc
            except base.RESUBMIT_ERRORS as exc:
                if attempt == base.RESUBMITS:
                    raise
                fault = exc
            await asyncio.sleep(base.RESUBMIT_DELAY_S * 2**attempt)

    async def submit(self, payload: Any, *, request_id: str | None = None,
                     reply_to: str | None = None, deadline_ms: int | None = None,
                     priority: int = 0) -> str:
        request_id = request_id or base.new_request_id()
        await models.learn_kind_async(self.redis, self.kind, self.namespace, self.model)
        fields = self._fields(payload, request_id, reply_to, deadline_ms, priority)
        await self._discover()
        if self.cycle is not None:
            await self._submit_sharded([request_id], [fields], reply_to is None)
        elif wanted := await self._wanted():
            await self._add_replicated([request_id], [fields], wanted)
        elif self.max_backlog is None:
            await self.redis.xadd(self.stream_key, fields)
        else:
            self._accepted(await self._add_if_under(keys=[self.stream_key],
                                                    args=self._add_arguments([fields])))
        return request_id

    async def submit_many(self, payloads: Sequence[Any], *, reply_to: str | None = None,
                          deadline_ms: int | None = None, priority: int = 0,
                          request_ids: Sequence[str] | None = None) -> list[str]:
        """`request_ids`: the requests' ids (a batch job's), else new ones."""
        ids: list[str] = []
        await models.learn_kind_async(self.redis, self.kind, self.namespace, self.model)
        await self._discover()
        if self.cycle is not None:
            for chunk_ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority,
                                                   request_ids):
                await self._submit_sharded(chunk_ids, entries, reply_to is None, ids)
                ids += chunk_ids
            return ids
        if wanted := await self._wanted():
            for chunk_ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority,
                                                   request_ids):
                await self._add_replicated(chunk_ids, entries, wanted, ids)
                ids += chunk_ids
            return ids
        if self.max_backlog is not None:
            for chunk_ids, args in self._limited_chunks(payloads, reply_to, deadline_ms,
                                                        priority, request_ids):
                self._accepted(await self._add_if_under(keys=[self.stream_key], args=args), ids)
                ids += chunk_ids
            return ids
        for chunk_ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority,
                                               request_ids):
            async with self.redis.pipeline(transaction=False) as pipe:
                for fields in entries:
                    pipe.xadd(self.stream_key, fields)
                await pipe.execute()
            ids += chunk_ids
        return ids

    async def wait(self, request_id: str, timeout: float = 30.0, reply_to: str | None = None,
                   as_numpy: bool | None = None) -> dict[str, Any]:
        if request_id in self._streamed:  # sent with "stream": true: its done envelope
            reading = streaming.StreamReading(request_id)
            async for _ in streaming.read_stream_async(
                    self.redis, self.token_stream(request_id, reply_to), reading,
                    base.block_slices(timeout)):
                pass
            self._streamed.pop(request_id, None)
            assert reading.done is not None
            return {**reading.done, "ok": bool(reading.done.get("ok"))}
        key = reply_to or self.reply_key(request_id)
        for block_s in base.block_slices(timeout):
            popped: Any = await self.redis.blpop([key], timeout=block_s)
            envelope = popped and self._own(popped[1], (request_id,))
            if envelope:
                self._forget(request_id)
                return with_embedding(envelope, self.as_numpy if as_numpy is None else as_numpy)
        raise ResultTimeout(f"no reply for request {request_id} within {timeout} s")

    async def result(self, request_id: str, timeout: float = 30.0,
                     as_numpy: bool | None = None) -> Any:
        return unwrap(await self.wait(request_id, timeout, as_numpy=as_numpy))

    async def infer(self, payload: Any, timeout: float = 30.0, as_numpy: bool | None = None,
                    **options: Any) -> Any:
        return await self.result(await self.submit(payload, **options), timeout, as_numpy)

    async def stream(self, payload: Any, timeout: float = 60.0, **options: Any
                     ) -> AsyncIterator[str | Any]:
        """Client.stream for asyncio: the answer's text as it comes, then the result."""
        request_id = await self.submit(streaming.streamed_payload(payload), **options)
        self._streamed.pop(request_id, None)
        reading = streaming.StreamReading(request_id)
        key = self.token_stream(request_id, options.get("reply_to"))
        async for text in streaming.read_stream_async(self.redis, key, reading,
                                                      base.block_slices(timeout)):
            yield text
        self.foreign_envelopes += reading.foreign
        self._forget(request_id)
        yield reading.final()

    async def models(self, idle_s: float = models.DEFAULT_IDLE_S
                     ) -> dict[str, models.LiveModel]:
        """Client.models for asyncio."""
        return await models.live_models_async(self.redis, self.namespace, idle_s)

    async def close(self) -> None:
        for node in self._nodes.values():
            await node.aclose()
        await self.redis.aclose()
