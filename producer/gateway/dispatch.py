"""One embeddings call's Redis round trips, through `producer.AsyncClient`.

All inputs of a call are submitted pipelined (submit_many) onto the model's stream, with the
call's deadline as each request's `deadline_ms` and one shared reply key, so they batch with
every other producer's traffic and come back on one list (one BLPOP wakes for them all).
Once every reply is popped the list no longer exists, so the reply key is only deleted after a
timeout or an error (late replies then find no one; the workers' PEXPIRE bounds them anyway).
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from producer import protocol
from producer.client import AsyncClient, Overloaded, block_slices
from producer.gateway import errors


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
        try:
            ids = await client.submit_many(payloads, reply_to=reply_to,
                                           deadline_ms=deadline_ms)
        except Overloaded as exc:
            raise errors.overloaded(exc.backlog, exc.max_backlog) from None
        complete = False
        try:
            by_id = await self._collect(reply_to, len(ids))
            complete = len(by_id) >= len(ids)
        finally:
            if not complete:  # a fully popped list is gone already: no round trip for it
                await self.redis.delete(reply_to)
        if not complete:
            raise errors.timed_out(self.timeout_s)
        return [by_id[request_id] for request_id in ids]

    async def _collect(self, reply_to: str, count: int) -> dict[str, dict[str, Any]]:
        """Envelopes by request id from the shared reply key, until all or the timeout."""
        found: dict[str, dict[str, Any]] = {}
        for block_s in block_slices(self.timeout_s):
            popped: Any = await self.redis.blpop([reply_to], timeout=block_s)
            if popped is None:
                continue
            more = count - len(found) - 1
            batch = [popped[1], *((await self.redis.lpop(reply_to, more) or []) if more else [])]
            for data in batch:
                envelope = protocol.decode_envelope(data)
                found[str(envelope.get("id"))] = envelope
            if len(found) >= count:
                break
        return found
