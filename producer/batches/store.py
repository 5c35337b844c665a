"""Files and batches in Redis: one call (a pipeline or a script of scripts.py) a method.

The gateway's routes and the runner share it. A batch's state changes touch only its slot;
the two writes that span slots (an object and its owner's index, a batch and the active set)
are ordered so that a crash between them leaves an object that exists but is not listed,
never an index entry without its object being skipped (listing drops such entries).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence
from typing import Any

from producer import connection, protocol
from producer.backlog import BACKLOG, published_shards
from producer.batches import keys, scripts
from producer.batches.keys import BatchKeys
from producer.shards import shard_stream_key, shards_key

READ_WINDOW = 1000  # lines per round trip when a file is read or written
UPLOAD_TTL_MS = 3_600_000  # an upload's lines, until it is published


class BatchStore:
    def __init__(self, redis: Any, namespace: str) -> None:
        self.redis, self.namespace = redis, namespace
        self._lease, self._create, self._backlog = (redis.register_script(s) for s in (
            scripts.LEASE, scripts.CREATE, BACKLOG))
        self._start, self._cancel, self._admit, self._settle, self._finish = (
            redis.register_script(s) for s in (scripts.START, scripts.CANCEL, scripts.ADMIT,
                                               scripts.SETTLE, scripts.FINISH))

    def keys(self, batch_id: str) -> BatchKeys:
        return BatchKeys(self.namespace, batch_id)

    # --- files -----------------------------------------------------------------------------

    async def save_lines(self, file_id: str, start: int, lines: Sequence[bytes]) -> None:
        """Lines `start`.. of an upload not yet published (invisible until publish_file);
        they expire UPLOAD_TTL_MS after the last window unless published (a client that
        broke off its upload leaves nothing behind)."""
        _, content = keys.file_keys(self.namespace, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(content, mapping={start + i: raw for i, raw in enumerate(lines)})
            pipe.pexpire(content, UPLOAD_TTL_MS)
            await pipe.execute()

    async def publish_file(self, meta: dict[str, Any]) -> None:
        """The file's object with its lines kept for good (one slot, one transaction),
        then its place in the owner's list."""
        found, content = keys.file_keys(self.namespace, meta["id"])
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(found, mapping=meta)
            pipe.persist(content)
            await pipe.execute()
        await self.redis.zadd(keys.file_index(self.namespace, meta["owner"]),
                              {meta["id"]: meta["created_ms"]})

    async def file_meta(self, file_id: str) -> dict[bytes, bytes]:
        found, _ = keys.file_keys(self.namespace, file_id)
        meta: dict[bytes, bytes] = await self.redis.hgetall(found)
        return meta

    async def read_lines(self, file_id: str, indices: Sequence[int]) -> list[bytes | None]:
        """An uploaded file's lines by index (None: gone, the file deleted)."""
        if not indices:
            return []
        _, content = keys.file_keys(self.namespace, file_id)
        lines: list[bytes | None] = await self.redis.hmget(content, list(indices))
        return lines

    async def read_output(self, file_id: str, start: int, count: int) -> list[bytes]:
        """Lines `start`.. of a batch's output or error file, so far."""
        _, content = keys.file_keys(self.namespace, file_id)
        lines: list[bytes] = await self.redis.lrange(content, start, start + count - 1)
        return lines

    async def drop_file(self, file_id: str, owner: str) -> None:
        """Unlisted first, then gone: two calls, as a cluster's pipeline runs each node's
        part at once, in no order (one slot's two keys are one DEL)."""
        found, content = keys.file_keys(self.namespace, file_id)
        await self.redis.zrem(keys.file_index(self.namespace, owner), file_id)
        await self.redis.delete(found, content)

    # --- listing ---------------------------------------------------------------------------

    async def page(self, index: str, after: str | None, limit: int) -> list[str]:
        """Up to `limit` + 1 ids, newest first, after `after` (OpenAI's cursor); the extra
        one says whether there are more."""
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after)
            start = 0 if rank is None else rank + 1
        ids = await self.redis.zrevrange(index, start, start + limit)
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def metas(self, found: Sequence[str]) -> list[dict[bytes, bytes]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in found:
                pipe.hgetall(key)
            metas: list[dict[bytes, bytes]] = await pipe.execute()
        return metas

    # --- batches ---------------------------------------------------------------------------

    async def create(self, meta: dict[str, Any]) -> bool:
        """The batch (False: one with its id exists, an Idempotency-Key's repeat) between
        its place in the active set and in the owner's list: a crash before the batch leaves
        an active id that runners drop (stale_ms), one after it a batch not listed, never a
        batch no runner finds."""
        batch_id, created_ms = meta["id"], meta["created_ms"]
        await self.redis.zadd(keys.active_batches(self.namespace), {batch_id: created_ms},
                              nx=True)
        fields = [part for pair in meta.items() for part in pair]
        created = bool(await self._create(keys=[self.keys(batch_id).meta], args=fields))
        if created:
            await self.redis.zadd(keys.batch_index(self.namespace, meta["owner"]),
                                  {batch_id: created_ms})
        return created

    async def batch_meta(self, batch_id: str) -> dict[bytes, bytes]:
        meta: dict[bytes, bytes] = await self.redis.hgetall(self.keys(batch_id).meta)
        return meta

    async def cancel(self, batch_id: str, now_s: int) -> None:
        await self._cancel(keys=[self.keys(batch_id).meta], args=[now_s])

    async def active(self) -> list[tuple[str, int]]:
        """(batch id, when it was listed, ms) of the batches not yet final."""
        found = await self.redis.zrange(keys.active_batches(self.namespace), 0, -1,
                                        withscores=True)
        return [(i.decode() if isinstance(i, bytes) else i, int(ms)) for i, ms in found]

    async def retire(self, batch_id: str) -> None:
        """A final batch leaves the active set (its runner found it final, or found none)."""
        await self.redis.zrem(keys.active_batches(self.namespace), batch_id)

    # --- the runner's steps ----------------------------------------------------------------

    async def backlog(self, model: str, group: str, cap: int) -> int:
        """The model's unacked entries, which admission weighs: on a cluster summed over its
        shards (one BACKLOG call each, as each shard is a slot of its own)."""
        streams = [protocol.stream_key(self.namespace, model)]
        if connection.is_cluster_client(self.redis):
            count = published_shards(await self.redis.get(shards_key(self.namespace, model)))
            streams = [shard_stream_key(self.namespace, model, s) for s in range(count or 0)]
        found = await asyncio.gather(*(self._backlog(keys=[s], args=[group, cap])
                                       for s in streams))
        return sum(int(n) for n in found)

    async def lease(self, batch_id: str, holder: str, ms: int, due_ms: int) -> bool:
        """Whether `holder` holds the batch (taken or renewed); taken over, its lines in
        flight are due again by `due_ms`."""
        k = self.keys(batch_id)
        return bool(await self._lease(keys=[k.lease, k.flight, k.deferred],
                                      args=[holder, ms, due_ms]))

    async def start(self, batch_id: str, status: str, now_s: int, total: int, errors: str,
                    model: str, order: Sequence[int] = ()) -> None:
        """Validated: in progress (its lines admitted in `order`) or failed."""
        k = self.keys(batch_id)
        packed = array("I", order).tobytes() if order else b""
        await self._start(keys=[k.meta, k.order],
                          args=[status, now_s, total, errors, model, packed])

    async def ordered(self, batch_id: str, start: int, count: int) -> list[int]:
        """The line numbers at positions start.. of the admission order (the positions
        themselves for a batch without one)."""
        packed = await self.redis.getrange(self.keys(batch_id).order, start * 4,
                                           (start + count) * 4 - 1) if count > 0 else b""
        if not packed:
            return list(range(start, start + max(count, 0)))
        return array("I", packed).tolist()

    async def progress(self, batch_id: str, replies: int, now_ms: int, due: int
                       ) -> tuple[list[bytes], bytes, int, list[int], int]:
        """(the oldest `replies` replies, the done bitmap, lines in flight, up to `due`
        lines due again now, replies waiting in all), in one round trip."""
        k = self.keys(batch_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lrange(k.reply, -replies, -1)
            pipe.get(k.done)
            pipe.hlen(k.flight)
            pipe.zrangebyscore(k.deferred, "-inf", now_ms, start=0, num=due)
            pipe.llen(k.reply)
            popped, done, flying, due_lines, waiting = await pipe.execute()
        return (list(reversed(popped)), done or b"", int(flying), [int(n) for n in due_lines],
                int(waiting))

    async def done(self, batch_id: str) -> bytes:
        """The bitmap of the lines answered."""
        return bytes(await self.redis.get(self.keys(batch_id).done) or b"")

    async def stop_in_flight(self, batch_id: str, ttl_ms: int) -> int:
        """Set the cancel key of each line in flight, so that a generation the workers hold
        ends within two steps (docs/protocol.md, Cancel); how many. Two calls: on a cluster
        the cancel keys lie in other slots than the batch's."""
        flight = await self.redis.hgetall(self.keys(batch_id).flight)
        async with self.redis.pipeline(transaction=False) as pipe:
            for line, attempt in flight.items():
                rid = keys.request_id(batch_id, int(line), int(attempt), 0)
                pipe.set(protocol.cancel_key(self.namespace, rid), 1, px=ttl_ms)
            await pipe.execute()
        return len(flight)

    async def attempts(self, batch_id: str, lines: Sequence[int]) -> list[int]:
        """The last attempt of each line (0: never admitted)."""
        if not lines:
            return []
        found = await self.redis.hmget(self.keys(batch_id).flight, list(lines))
        return [int(a) if a is not None else 0 for a in found]

    async def parts(self, batch_id: str, request_ids: Sequence[str]) -> list[bytes | None]:
        """Envelopes kept of lines of several requests, by request id."""
        if not request_ids:
            return []
        found: list[bytes | None] = await self.redis.hmget(self.keys(batch_id).parts,
                                                           list(request_ids))
        return found

    async def admit(self, batch_id: str, cursor: int, timeout_ms: int,
                    lines: Sequence[tuple[int, int]]) -> int:
        k = self.keys(batch_id)
        args: list[Any] = [cursor, timeout_ms, *(n for pair in lines for n in pair)]
        return int(await self._admit(keys=[k.meta, k.done, k.flight, k.deferred], args=args))

    async def settle(self, batch_id: str, handled: int, answers: Sequence[tuple[int, bool,
                     bytes]], retries: Sequence[tuple[int, int, int]],
                     kept: Sequence[tuple[str, bytes]], dropped: Sequence[str]) -> int:
        k = self.keys(batch_id)
        args: list[Any] = [handled, len(answers)]
        for line, ok, out in answers:
            args += [line, int(ok), out]
        args.append(len(retries))
        for retry in retries:
            args += list(retry)
        args.append(len(kept))
        for pair in kept:
            args += list(pair)
        args += [len(dropped), *dropped]
        return int(await self._settle(keys=[k.meta, k.done, k.flight, k.deferred, k.parts,
                                            k.output, k.errors, k.reply], args=args))

    async def finish(self, batch_id: str, status: str, now_s: int, final: bool,
                     unanswered: Sequence[tuple[int, bytes]]) -> None:
        k = self.keys(batch_id)
        args: list[Any] = [status, now_s, int(final), *(v for pair in unanswered for v in pair)]
        await self._finish(keys=[k.meta, k.done, k.flight, k.deferred, k.parts, k.output,
                                 k.errors, k.output_meta, k.errors_meta, k.order], args=args)
