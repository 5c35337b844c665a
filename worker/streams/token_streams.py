"""Streamed replies of generative models: one Redis stream per request.

Chunk n (1, 2, ...) is written with `XADD <key> <n>-1 data <envelope>`: an explicit id, so a
chunk written twice (a retried pipeline) is refused by Redis ("equal or smaller than the
target stream top item") and never seen twice; that refusal counts as written. Each write
renews `PEXPIRE result_ttl_ms`. A step's chunks and the step's cancel check (one MGET of
the running requests' cancel keys) go in one round trip.

The last entry (`type: done`) and the XACK of the request's entry are one Lua script,
ownership-checked like streams/replier.py: written only while this consumer owns the entry.

Durability (docs/protocol.md, "Generative models"): `progress` reads what a reply stream
already holds, so a worker that took a request over continues it at the next chunk; and
`keep_alive` claims the owner's running entries to itself (idle time back to 0, delivery
count unchanged) more often than `claim_idle_ms`, so a live generation is never claimed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer import connection, protocol
from producer.replicas import ReplicaCount
from worker.streams.reader import as_text, is_group_lost
from worker.streams.replier import ReplicatedScript, wrong_type

ALREADY_WRITTEN = "equal or smaller"  # XADD's refusal of an id not above the last one

# Appends a `done` entry; shared by FINISH_AND_ACK and, on a Redis Cluster, the write of a
# done entry to a reply stream in another slot (streams/shard_token_streams.py).
# The id is taken when the stream holds more than this worker wrote (chunks of a previous
# owner, before an error answer found no progress): then the done entry goes after its last
# entry, unless that one is a done entry already (nothing is left to write).
APPEND_DONE = """
local function after_top(key)  -- the id after the last entry; nil if that one is `done`
  local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  if not top then return nil end
  local data = top[2][2]
  local ok, envelope
  if string.sub(data or '', 1, 1) == '{' then ok, envelope = pcall(cjson.decode, data)
  else ok, envelope = pcall(cmsgpack.unpack, data or '') end
  if ok and type(envelope) == 'table' and envelope['type'] == 'done' then return nil end
  return (tonumber(string.match(top[1], '^(%d+)')) + 1) .. '-1'
end
-- nil when written (or there already), else the refusal; a key that is not a stream is
-- skipped (acked all the same, or the entry would come back forever)
local function append_done(key, id, data, ttl)
  local added = redis.pcall('XADD', key, id, 'data', data)
  if type(added) == 'table' and added.err
      and string.find(added.err, 'equal or smaller', 1, true) then
    local next_id = after_top(key)
    added = next_id and redis.pcall('XADD', key, next_id, 'data', data) or 'done'
  end
  if type(added) == 'table' and added.err then
    if string.find(added.err, 'WRONGTYPE', 1, true) then return nil end
    return added
  end
  redis.call('PEXPIRE', key, ttl)
  return nil
end
"""

FINISH_AND_ACK = APPEND_DONE + """
-- KEYS[1] request stream, KEYS[2] answered counter, KEYS[3..n+2] reply streams
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] ttl ms, then n triples: entry id, chunk id, data
-- (empty data: only the ack, the done entry was written elsewhere first).
-- Returns {the entry ids not answered because this consumer no longer owns them, 1 if the
-- answered counter holds another type}.
local stream, group, consumer, ttl = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local dropped, acked = {}, 0
for i = 1, #KEYS - 2 do
  local id, data = ARGV[3 * i + 1], ARGV[3 * i + 3]
  if #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 1 then
    if data ~= '' then
      local refused = append_done(KEYS[i + 2], ARGV[3 * i + 2], data, ttl)
      if refused then return redis.error_reply(refused.err) end  -- OOM: before the ack
    end
    redis.call('XACK', stream, group, id)
    acked = acked + 1
  else
    dropped[#dropped + 1] = id
  end
end
local counted = redis.pcall('INCRBY', KEYS[2], acked)  -- squatted by another type: skipped
return {dropped, (type(counted) == 'table' and counted.err) and 1 or 0}
"""

WRITE_CHUNKS = """
-- KEYS[1..n] the chunks' reply streams, then the cancel keys to read.
-- ARGV[1] ttl ms, ARGV[2] n, then per chunk: its id, its data.
-- A chunk already there counts as written; a key of another type is skipped and never
-- expired. Returns 1 or 0 per cancel key: set or not.
local ttl, n = ARGV[1], tonumber(ARGV[2])
for i = 1, n do
  local added = redis.pcall('XADD', KEYS[i], ARGV[2 * i + 1], 'data', ARGV[2 * i + 2])
  local err = type(added) == 'table' and added.err
  if not err or string.find(err, 'equal or smaller', 1, true) then
    redis.call('PEXPIRE', KEYS[i], ttl)
  elseif not string.find(err, 'WRONGTYPE', 1, true) then
    return redis.error_reply(err)  -- e.g. OOM under noeviction
  end
end
local flags = {}
for i = n + 1, #KEYS do flags[#flags + 1] = redis.call('EXISTS', KEYS[i]) end
return flags
"""

KEEP_ALIVE = """
-- KEYS[1] request stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids.
-- Claims to this consumer (JUSTID: the delivery count is not raised) the ids still pending
-- for it; returns the others (claimed by another consumer, or acked).
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local claim, lost = {'XCLAIM', stream, group, consumer, '0'}, {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', stream, group, ARGV[i], ARGV[i], 1, consumer) == 1 then
    claim[#claim + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if #claim > 5 then
  claim[#claim + 1] = 'JUSTID'
  redis.call(unpack(claim))
end
return lost
"""


def _written(result: Any) -> bool:
    """An XADD that wrote its chunk, or found it written already."""
    if isinstance(result, redis.ResponseError):
        if ALREADY_WRITTEN in str(result):
            return True
        if "WRONGTYPE" in str(result):
            return False
    if isinstance(result, Exception):
        raise result
    return True


@dataclass(slots=True)
class Progress:
    """What a reply stream already holds: the deltas (their last index, tokens and text)
    and the `done` entry if there is one."""

    chunks: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    done: dict[str, Any] | None = None
    done_index: int = 0
    overfull: bool = False  # more tokens than the request may generate: no worker wrote it


def progress_of(entries: Any, max_tokens: int | None = None) -> Progress:
    """XRANGE's reply, parsed; entries that are no envelope of ours are skipped. Past
    `max_tokens` tokens it stops, `overfull`: a producer can write this key, and resuming
    a stream of millions of tokens would hold up every other request of the worker."""
    found = Progress()
    for entry_id, fields in entries if isinstance(entries, list) else []:
        try:
            index = int(as_text(entry_id).split("-")[0])
            data = fields[b"data"]
            envelope = protocol.decode(data, protocol.JSON if data[:1] == b"{"
                                       else protocol.MSGPACK)
        except (KeyError, ValueError, TypeError):
            continue
        if not isinstance(envelope, dict):
            continue
        if envelope.get("type") == "done":
            found.done, found.done_index = envelope, index
            break
        if envelope.get("type") == "delta":
            token_ids, text = envelope.get("token_ids") or [], envelope.get("text") or ""
            if not (isinstance(text, str) and isinstance(token_ids, list)
                    and all(type(t) is int and 0 <= t < 1 << 31 for t in token_ids)):
                continue  # not a delta a worker wrote (a producer can write this key)
            found.chunks = index
            found.token_ids += token_ids
            found.text += text
            if max_tokens is not None and len(found.token_ids) > max_tokens:
                found.overfull = True
                break
    return found


@dataclass(frozen=True, slots=True)
class Chunk:
    """One entry of a reply stream: `<index>-1 data <envelope>`."""

    key: str
    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class FinalChunk:
    entry_id: str  # the request's entry, acked with it
    chunk: Chunk


class TokenStreams:
    """Writes reply streams for one request stream on behalf of one consumer."""

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str,
                 ttl_ms: int, answered_key: str, model_name: str = "",
                 replicas: ReplicaCount | None = None) -> None:
        """`replicas`: WAIT for that many replicas after each done entry and its ack (as
        the Replier does after a reply); chunks do not wait."""
        self.client = client
        self.stream, self.group, self.consumer = stream, group, consumer
        self.ttl_ms = ttl_ms
        self.answered_key = answered_key
        self._cluster = connection.is_cluster_client(client)
        self.model_name = model_name or stream.rpartition(":")[2]
        self._finish = ReplicatedScript(client, stream, FINISH_AND_ACK, self.model_name,
                                        replicas or ReplicaCount(0))
        self._keep_alive = client.register_script(KEEP_ALIVE)
        self._write_chunks = client.register_script(WRITE_CHUNKS)

    def progress(self, keys: Sequence[str], max_tokens: Sequence[int]) -> list[Progress]:
        """What each reply stream holds already, up to its request's `max_new_tokens` (one
        XRANGE each, one round trip). A worker writes at most one delta per token, then its
        done entry: what lies beyond is no worker's, and is not read."""
        pipe = self.client.pipeline(transaction=False)
        for key, limit in zip(keys, max_tokens, strict=True):
            pipe.xrange(key, count=limit + 2)
        return [progress_of(entries, limit) for entries, limit
                in zip(pipe.execute(raise_on_error=False), max_tokens, strict=True)]

    def keep_alive(self, entry_ids: Sequence[str]) -> list[str]:
        """Claim our running entries to ourselves (one script call); returns those no longer
        ours, whose generation should stop."""
        if not entry_ids:
            return []
        try:
            lost: list[bytes] = self._keep_alive(keys=[self.stream],
                                                 args=[self.group, self.consumer, *entry_ids])
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return list(entry_ids)
        return [as_text(i) for i in lost]

    def write(self, chunks: Sequence[Chunk], cancel_keys: Sequence[str] = ()) -> list[bool]:
        """Append the chunks (one already there counts as written) and renew the TTL of the
        streams written, never of a key of another type; returns, for each cancel key,
        whether it is set. One round trip (two on a Redis Cluster, whose keys span slots)."""
        if self._cluster:
            return self._write_on_cluster(chunks, cancel_keys)
        args: list[str | bytes | int] = [self.ttl_ms, len(chunks)]
        for chunk in chunks:
            args += (f"{chunk.index}-1", chunk.data)
        flags = self._write_chunks(keys=[*(c.key for c in chunks), *cancel_keys], args=args)
        return [bool(flag) for flag in flags]

    def _write_on_cluster(self, chunks: Sequence[Chunk], cancel_keys: Sequence[str]
                          ) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for chunk in chunks:
            pipe.xadd(chunk.key, {"data": chunk.data}, id=f"{chunk.index}-1")
        for key in cancel_keys:  # the keys are in many slots: one GET each, per node
            pipe.get(key)
        results = pipe.execute(raise_on_error=False)
        written = [chunk.key for chunk, result in zip(chunks, results, strict=False)
                   if _written(result)]
        if written:
            pipe = self.client.pipeline(transaction=False)
            for key in dict.fromkeys(written):
                pipe.pexpire(key, self.ttl_ms)
            pipe.execute()
        return [value is not None for value in results[len(chunks):]]

    def finish(self, finals: Sequence[FinalChunk]) -> list[str]:
        """The last entry of each reply stream with the XACK of its request, atomically;
        returns the entry ids dropped as no longer ours."""
        if not finals:
            return []
        keys = [self.stream, self.answered_key, *(f.chunk.key for f in finals)]
        args: list[str | bytes | int] = [self.group, self.consumer, self.ttl_ms]
        for final in finals:
            args += (final.entry_id, f"{final.chunk.index}-1", final.chunk.data)
        try:
            dropped, miscounted = self._finish.run(keys, args)
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return [f.entry_id for f in finals]
        if miscounted:
            wrong_type(self.model_name, "answered", self.answered_key)
        return [as_text(d) for d in dropped]
