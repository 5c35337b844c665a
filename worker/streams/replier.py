"""Replying: each answer and the XACK of its entry in one atomic Lua script.

The script writes a reply only while this consumer still owns the entry (it is in this
consumer's pending list). So no entry is acked without its answer, and a worker whose
entries were claimed by another while it was frozen drops its late result instead of
answering twice. The same script counts the replies written, for throughput and drain time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from producer import connection
from producer.replicas import ReplicaCount
from worker.observe import metrics
from worker.streams.reader import as_text, is_group_lost

log = structlog.get_logger("redbatch.replier")
MOVED_RETRIES = 3  # a slot that moves again each time: TRYAGAIN, for RedisRetry's backoff

REPLY_AND_ACK = """
-- KEYS[1] stream, KEYS[2] answered counter, KEYS[3..n+2] reply keys
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] ttl ms, then n pairs: entry id, envelope
-- Returns {ids not answered because this consumer no longer owns them, ids whose reply key
-- holds another type than a list (a producer's mistake: acked all the same, or they would
-- come back forever), 1 if the answered counter holds another type than a string}.
-- Per entry it costs one LPUSH, plus one PEXPIRE per distinct reply key: ownership is read
-- with one XPENDING over the range of the ids, and the answered ones go in one XACK.
-- On a cluster, an entry whose reply key is in another slot was answered by ForeignReplies
-- (shard_replies.py) and comes with the stream as its key and an empty envelope: ack only.
local stream, group, consumer, ttl = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local n = #KEYS - 2

local function parse(id)  -- stream ids order by (ms, seq)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local first, last = ARGV[4], ARGV[4]
local first_ms, first_seq = parse(first)
local last_ms, last_seq = first_ms, first_seq
for i = 2, n do
  local id = ARGV[2 * i + 2]
  local ms, seq = parse(id)
  if ms < first_ms or (ms == first_ms and seq < first_seq) then
    first, first_ms, first_seq = id, ms, seq
  end
  if ms > last_ms or (ms == last_ms and seq > last_seq) then
    last, last_ms, last_seq = id, ms, seq
  end
end
local owned = {}
for _, p in ipairs(redis.call('XPENDING', stream, group, first, last, 1000000000, consumer)) do
  owned[p[1]] = true
end

local dropped, undeliverable, acked, expiring = {}, {}, {}, {}
for i = 1, n do
  local id, key = ARGV[2 * i + 2], KEYS[i + 2]
  if owned[id] then
    owned[id] = nil  -- an id given twice is answered once
    local envelope = ARGV[2 * i + 3]
    if key ~= stream or envelope ~= '' then  -- else answered on another node: ack only
      local pushed = redis.pcall('LPUSH', key, envelope)
      if type(pushed) == 'table' and pushed.err then
        if not string.find(pushed.err, 'WRONGTYPE', 1, true) then
          -- e.g. OOM under noeviction: refused at the first write, so nothing is written
          return redis.error_reply(pushed.err)
        end
        undeliverable[#undeliverable + 1] = id
      elseif not expiring[key] then
        redis.call('PEXPIRE', key, ttl)
        expiring[key] = true
      end
    end
    acked[#acked + 1] = id
  else
    dropped[#dropped + 1] = id
  end
end
for i = 1, #acked, 1000 do  -- within Lua's limit on unpacked values
  redis.call('XACK', stream, group, unpack(acked, i, math.min(i + 999, #acked)))
end
-- acked, so off the backlog; a counter squatted by another type is skipped, not fatal
local counted = redis.pcall('INCRBY', KEYS[2], #acked)
return {dropped, undeliverable, (type(counted) == 'table' and counted.err) and 1 or 0}
"""


@dataclass(slots=True)
class Reply:
    entry_id: str
    reply_key: str
    envelope: bytes


def wrong_type(model_name: str, kind: str, key: str) -> None:
    """An internal key that holds another type (squatted, or written by hand): its write is
    skipped, counted and logged, and serving goes on. `kind`: answered, workers or dead."""
    metrics.INTERNAL_KEY_ERRORS.labels(model_name, kind).inc()
    log.warning("internal_key.wrong_type", key=key,
                hint="the key holds another type; delete it (redbatch recreates it)")


class ReplicatedScript:
    """A script run on a stream's master, then (when replicas are wanted) WAIT on the same
    connection: a plain pipeline, on a cluster to the stream's master
    (connection.node_client). A short WAIT is counted; what the script did stands all the
    same (replication is asynchronous: WAIT narrows the window of loss, it cannot close it)."""

    def __init__(self, client: Any, stream: str, script: str, model_name: str,
                 replicas: ReplicaCount) -> None:
        self.client, self.stream, self.model_name = client, stream, model_name
        self.replicas = replicas
        self._script = client.register_script(script)

    def run(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        for _ in range(MOVED_RETRIES):
            try:
                return self._run_once(keys, args)
            except redis.exceptions.MovedError as exc:  # the cluster client follows its own
                connection.follow_cluster(self.client, exc)
            except redis.exceptions.AskError:  # a slot mid-migration: redis-py sends ASKING
                metrics.REPLICATION_SHORT.labels(self.model_name).inc()  # no WAIT this once
                return self._script(keys=keys, args=args)
            except connection.CLUSTER_FAULTS as exc:
                connection.follow_cluster(self.client, exc)
                raise
        raise redis.exceptions.TryAgainError(f"{self.stream}: its slot keeps moving")

    def _run_once(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        node = connection.node_client(self.client, self.stream)
        wanted = self.replicas.count(node)
        if not wanted:
            return self._script(keys=keys, args=args)
        result, acked = script_then_wait(node, self._script, keys, args, wanted,
                                         self.replicas.timeout_ms)
        if acked < wanted:
            metrics.REPLICATION_SHORT.labels(self.model_name).inc()
            self.replicas.short()
            log.debug("replies.replication_short", replicas=acked, wanted=wanted)
        return result


class Replier:
    """Writes answers for one stream on behalf of one consumer."""

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str,
                 ttl_ms: int, answered_key: str, model_name: str = "",
                 replicas: ReplicaCount | None = None) -> None:
        """`replicas`: WAIT for that many replicas after each write, on its connection."""
        self.client = client
        self.stream = stream
        self.answered_key = answered_key
        self.group = group
        self.consumer = consumer
        self.ttl_ms = ttl_ms
        self.model_name = model_name or stream.rpartition(":")[2]
        self.replicas = replicas or ReplicaCount(0)
        self.defers = False  # see ShardedReplier
        self._writes = ReplicatedScript(client, stream, REPLY_AND_ACK, self.model_name,
                                        self.replicas)

    def send_available(self, replies: Sequence[Reply]) -> tuple[list[str], list[str]]:
        """(dropped ids, deferred ids): one Redis defers nothing (its faults are retried)."""
        return self.send(replies), []

    def next_retry_s(self) -> float:
        return 0.0

    def send(self, replies: Sequence[Reply]) -> list[str]:
        """Answer and ack atomically; returns the entry ids dropped as no longer ours."""
        if not replies:
            return []
        keys = [self.stream, self.answered_key, *(r.reply_key for r in replies)]
        args: list[str | bytes | int] = [self.group, self.consumer, self.ttl_ms]
        for r in replies:
            args += (r.entry_id, r.envelope)
        try:
            dropped, undeliverable, miscounted = self._write(keys, args)
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return [r.entry_id for r in replies]  # Redis lost the group: none of them is ours
        if miscounted:
            wrong_type(self.model_name, "answered", self.answered_key)
        if undeliverable:
            metrics.UNANSWERABLE.labels(self.model_name, "reply_key_type").inc(len(undeliverable))
            log.warning("replies.undeliverable", reason="reply key is not a list",
                        entry_ids=[as_text(u) for u in undeliverable])
        return [as_text(d) for d in dropped]

    def _write(self, keys: list[str], args: list[str | bytes | int]) -> list[Any]:
        result: list[Any] = self._writes.run(keys, args)
        return result

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Ack entries that cannot be answered (no usable id, or deleted from the stream)."""
        if entry_ids:
            self.client.xack(self.stream, self.group, *entry_ids)


def script_then_wait(node: Any, script: Any, keys: Sequence[str], args: Sequence[Any],
                     wanted: int, timeout_ms: int) -> tuple[Any, int]:
    """EVALSHA and WAIT in one pipeline on the node's own connection. A redis-py Script in a
    pipeline first sends SCRIPT EXISTS, a round trip per write; instead a NOSCRIPT (a
    promoted replica that never loaded the script) loads it, and the pair is sent again
    (nothing ran: WAIT alone is harmless)."""
    for attempt in (0, 1):
        pipe = node.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        pipe.wait(wanted, timeout_ms)
        try:
            result, acked = pipe.execute()
            return result, int(acked)
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            node.script_load(script.script)
    raise AssertionError("unreachable")
