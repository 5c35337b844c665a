"""One embeddings call's Redis round trips.

All inputs of a call are submitted pipelined onto the model's stream, with the call's deadline
as each request's `deadline_ms` and one shared reply key, so they batch with every other
producer's traffic and come back on one list (one BLPOP wakes for them all).

On a plain Redis with nothing to wait for (no `max_backlog`, no replica to WAIT for) the XADDs
and the first BLPOP go in one pipeline: one round trip, and one wake-up of the gateway less
per call, than submit_many and then BLPOP (Redis runs a connection's commands in order, so the
BLPOP blocks after the XADDs). Otherwise `producer.AsyncClient.submit_many` submits them
(back-pressure, WAIT, a cluster's shards) and the BLPOPs follow.
Once every reply is popped the list no longer exists, so the reply key is only deleted after a
timeout or an error (late replies then find no one; the workers' PEXPIRE bounds them anyway).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import redis.asyncio as aioredis

from producer import connection, protocol, request_entry
from producer.async_client import AsyncClient
from producer.errors import Overloaded
from producer.gateway import errors
from producer.gateway.metrics import FOREIGN_ENVELOPES
from producer.request_base import PIPELINE_CHUNK, block_slices, new_request_id


class Dispatcher:
    """Submits payloads for a model and collects their envelopes in input order."""

    def __init__(self, redis: aioredis.Redis, namespace: str, group: str,
                 max_backlog: int | None, timeout_s: float) -> None:
        self.redis = redis
        self.namespace = namespace
        self.group = group
        self.max_backlog = max_backlog
        self.timeout_s = timeout_s
        self._clients: dict[str, AsyncClient] = {}
        self._plain = not connection.is_cluster_client(redis)

    def client(self, model: str) -> AsyncClient:
        """One AsyncClient per model, all on the one connection pool."""
        if model not in self._clients:
            self._clients[model] = AsyncClient(model=model, namespace=self.namespace,
                                               redis_client=self.redis, group=self.group,
                                               max_backlog=self.max_backlog)
        return self._clients[model]

    async def run(self, model: str, payloads: list[Any]) -> list[dict[str, Any]]:
        """Every payload's envelope, in order; ApiError for back-pressure or a timeout."""
        client = self.client(model)
        reply_to = client.new_reply_key()
        deadline_ms = int(time.time() * 1000 + self.timeout_s * 1000)
        slices = block_slices(self.timeout_s)
        popped: Any = None
        try:
            if await self._pipelinable(client, len(payloads)):
                ids, popped = await self._submit_and_pop(client, payloads, reply_to,
                                                         deadline_ms, next(slices))
            else:
                ids = await client.submit_many(payloads, reply_to=reply_to,
                                               deadline_ms=deadline_ms)
        except Overloaded as exc:
            raise errors.overloaded(exc.backlog, exc.max_backlog) from None
        complete = False
        try:
            by_id = await self._collect(reply_to, set(ids), slices, popped)
            complete = len(by_id) >= len(ids)
        finally:
            if not complete:  # a fully popped list is gone already: no round trip for it
                await self.redis.delete(reply_to)
        if not complete:
            raise errors.timed_out(self.timeout_s)
        return [by_id[request_id] for request_id in ids]

    async def _pipelinable(self, client: AsyncClient, count: int) -> bool:
        """Whether XADDs and BLPOP may share a pipeline: a plain Redis, no back-pressure
        script, no WAIT (the replica count as AsyncClient reads it: INFO, every 30 s)."""
        if not self._plain or self.max_backlog is not None or count > PIPELINE_CHUNK:
            return False
        if client.replicas.needs_reading():
            client.replicas.update(await self.redis.info("replication"))
        return client.replicas.current() == 0

    async def _submit_and_pop(self, client: AsyncClient, payloads: list[Any], reply_to: str,
                              deadline_ms: int, block_s: float) -> tuple[list[str], Any]:
        """The requests' ids and the first BLPOP's answer, from one round trip."""
        ids = [new_request_id() for _ in payloads]
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id, payload in zip(ids, payloads, strict=True):
                fields: Any = request_entry.entry_fields(  # what AsyncClient.submit_many sends
                    request_id, protocol.encode(payload, client.content_type),
                    content_type=client.content_type, reply_to=reply_to,
                    deadline_ms=deadline_ms)
                pipe.xadd(client.stream_key, fields)
            pipe.blpop([reply_to], timeout=block_s)
            answers = await pipe.execute()
        return ids, answers[-1]

    async def _collect(self, reply_to: str, ids: set[str], slices: Iterator[float],
                       popped: Any = None) -> dict[str, dict[str, Any]]:
        """Envelopes by request id from the shared reply key, until all or the timeout;
        `popped`: a BLPOP answer already in hand. Envelopes of other ids are dropped (any
        producer may name this key as its reply_to) and counted."""
        found: dict[str, dict[str, Any]] = {}
        while True:
            if popped is not None:
                more = len(ids) - len(found) - 1
                batch = [popped[1], *((await self.redis.lpop(reply_to, more) or [])
                                      if more else [])]
                for data in batch:
                    envelope = protocol.envelope_for(data, ids)
                    if envelope is None:
                        FOREIGN_ENVELOPES.inc()
                        continue
                    found[str(envelope["id"])] = envelope
                if len(found) >= len(ids):
                    return found
            block_s = next(slices, None)
            if block_s is None:
                return found
            popped = await self.redis.blpop([reply_to], timeout=block_s)
