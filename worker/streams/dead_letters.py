"""Poison entries: after `max_deliveries` deliveries an entry goes to a dead-letter stream.

An entry that keeps coming back (its worker crashed or hung on it every time) would
otherwise loop forever. Only redelivered entries (own pending drain, claimed) are checked,
so fresh reads pay nothing. Moving one is one Lua script: copy its fields, the reason and
the delivery count to `<namespace>:dead:<model>`, answer `dead_letter`, and ack it — and only
while this consumer still owns it, like every other reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
import structlog

from producer import protocol, request_entry
from producer.entry_rules import EntryRules
from producer.protocol import ErrorCode
from producer.request_entry import InvalidEntry
from producer.shards import key_slot
from worker.observe import metrics
from worker.streams.reader import Entry, Fields, as_text, is_group_lost
from worker.streams.replier import Reply, wrong_type

if TYPE_CHECKING:
    from worker.streams.shard_replies import ForeignReplies

log = structlog.get_logger("redbatch.deadletter")
DEAD_LETTER_MAXLEN = 100_000  # approximate cap on the dead-letter stream
META_PREFIX = "dead:"  # fields added to the original ones; stripped again on requeue

MOVE_TO_DEAD = """
-- KEYS[1] stream, KEYS[2] dead-letter stream, KEYS[3..n+2] reply keys ('' when none)
-- ARGV[1] group, ARGV[2] consumer, ARGV[3] reply ttl ms, ARGV[4] dead-letter maxlen,
-- then per entry: entry id, deliveries, reason, envelope. Returns {the ids moved, 1 if the
-- dead-letter stream holds another type}. An entry's fields are copied up to max_values,
-- but for those named dead:*: a producer's would shadow (forge) the metadata written here.
local stream, dead = KEYS[1], KEYS[2]
local group, consumer, ttl, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local max_values = 2 * 64
local moved, uncopied = {}, 0
for i = 3, #KEYS do
  local a = 5 + (i - 3) * 4
  local entry_id, deliveries, reason, envelope = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  if #redis.call('XPENDING', stream, group, entry_id, entry_id, 1, consumer) == 1 then
    local found = redis.call('XRANGE', stream, entry_id, entry_id)
    local fields = (#found == 1 and found[1][2]) or {}
    local copy = {'XADD', dead, 'MAXLEN', '~', maxlen, '*', 'dead:entry_id', entry_id,
                  'dead:deliveries', deliveries, 'dead:error', reason, 'dead:consumer', consumer}
    if #fields > max_values then  -- within Lua's stack: the first fields, and how many
      copy[#copy + 1], copy[#copy + 2] = 'dead:fields', tostring(#fields / 2)
    end
    for f = 1, math.min(#fields, max_values), 2 do
      if string.sub(fields[f], 1, 5) ~= 'dead:' then
        copy[#copy + 1], copy[#copy + 2] = fields[f], fields[f + 1]
      end
    end
    local added = redis.pcall(unpack(copy))
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'WRONGTYPE', 1, true) then
        return redis.error_reply(added.err)
      end
      uncopied = 1  -- the dead-letter stream is squatted: answered and acked all the same
    end
    if KEYS[i] ~= '' and type(redis.pcall('LPUSH', KEYS[i], envelope)) == 'number' then
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
    redis.call('XACK', stream, group, entry_id)
    moved[#moved + 1] = entry_id
  end
end
return {moved, uncopied}
"""

REQUEUE = """
-- KEYS[1] dead-letter stream, KEYS[2] request stream; ARGV: dead-letter entry ids.
-- Each entry goes back on the request stream with its original fields. Returns the new ids.
local added = {}
for _, dead_id in ipairs(ARGV) do
  local found = redis.call('XRANGE', KEYS[1], dead_id, dead_id)
  if #found == 1 then
    local fields, original = found[1][2], {}
    for i = 1, #fields, 2 do
      if string.sub(fields[i], 1, 5) ~= 'dead:' then
        original[#original + 1] = fields[i]
        original[#original + 1] = fields[i + 1]
      end
    end
    if #original > 0 then
      added[#added + 1] = redis.call('XADD', KEYS[2], '*', unpack(original))
    end
    redis.call('XDEL', KEYS[1], dead_id)
  end
end
return added
"""

LIST = """
-- KEYS[1] dead-letter stream; ARGV[1] count. XRANGE as Redis sends it: its fields as pairs
-- in order (redis-py's xrange makes a dict in which a repeated name's last value wins).
return redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', ARGV[1])
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry as kept in the dead-letter stream."""

    id: str
    fields: dict[str, str]

    def summary(self) -> dict[str, str | int]:
        """What an operator needs to decide on it (the payload only by size)."""
        fields = self.fields
        deliveries = fields.get("dead:deliveries", "0")
        return {"dead_letter_id": self.id, "request_id": fields.get("id", ""),
                "entry_id": fields.get("dead:entry_id", ""),
                # shown, not trusted: a dead letter written by an older worker may hold any text
                "deliveries": int(deliveries) if deliveries.isascii() and deliveries.isdigit()
                else "unknown",
                "error": fields.get("dead:error", ""), "consumer": fields.get("dead:consumer", ""),
                "payload_bytes": len(fields.get("payload", ""))}


def is_poison(deliveries: int, max_deliveries: int) -> bool:
    return deliveries > max_deliveries


def reply_target(fields: Fields | None, rules: EntryRules
                 ) -> tuple[str, str, str] | None:
    """(request id, reply list, content type) of an entry, when it can be answered at all:
    its reply_to when that is a list reply key, else its default reply key."""
    if fields is None:
        return None
    try:
        request = request_entry.parse_entry(fields, rules.namespace, rules.max_payload_bytes,
                                            reply_prefixes=rules.reply_prefixes)
    except InvalidEntry as exc:
        if not exc.answerable:
            return None
        assert exc.request_id is not None and exc.reply_to is not None
        request = request_entry.Request(exc.request_id, b"", exc.content_type, exc.reply_to,
                                        default_reply=exc.default_reply or exc.reply_to)
    listed = request.reply_to if rules.list_reply_allowed(request.reply_to) \
        else request.default_reply
    return request.id, listed, request.content_type


class DeadLetters:
    """Diverts poison entries of one stream, for one consumer."""

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, *,
                 namespace: str, model_name: str, max_deliveries: int, result_ttl_ms: int,
                 max_payload_bytes: int, reply_prefixes: tuple[str, ...] = ()) -> None:
        self.client = client
        self.stream = stream
        self.dead_stream = protocol.dead_letter_key(namespace, model_name)
        self.group = group
        self.consumer = consumer
        self.namespace = namespace
        self.model_name = model_name
        self.max_deliveries = max_deliveries
        self.result_ttl_ms = result_ttl_ms
        self.rules = EntryRules(namespace, max_payload_bytes, reply_prefixes)
        self._move = client.register_script(MOVE_TO_DEAD)
        self.foreign: ForeignReplies | None = None  # on a cluster (shard_upkeep.py)

    def divert(self, entries: Sequence[Entry]) -> list[Entry]:
        """Move the poison ones among redelivered entries; return those still to serve.

        A redelivered entry this consumer no longer owns (claimed by another meanwhile) is
        left out too: its answer would be dropped anyway.
        """
        redelivered = [e for e in entries if e.redelivered]
        if not redelivered:
            return list(entries)
        metrics.REDELIVERIES.labels(self.model_name).inc(len(redelivered))
        try:
            counts = self.delivery_counts([e.id for e in redelivered])
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return []  # the group is gone with its pending entries: none of these is ours
        poison = [e for e in redelivered
                  if e.id in counts and is_poison(counts[e.id], self.max_deliveries)]
        if poison:
            self.move(poison, counts)
        poison_ids = {e.id for e in poison}
        return [e for e in entries
                if not e.redelivered or (e.id in counts and e.id not in poison_ids)]

    def delivery_counts(self, entry_ids: Sequence[str]) -> dict[str, int]:
        """Times delivered, for the given entries this consumer owns (XPENDING, no increment)."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1, self.consumer)
        return {row["message_id"].decode(): int(row["times_delivered"])
                for rows in pipe.execute() for row in rows}

    def move(self, entries: Sequence[Entry], counts: dict[str, int]) -> list[str]:
        """Dead-letter, answer and ack these entries in one script; returns the ids moved."""
        keys: list[str] = [self.stream, self.dead_stream]
        args: list[str | bytes | int] = [self.group, self.consumer, self.result_ttl_ms,
                                         DEAD_LETTER_MAXLEN]
        foreign: list[Reply] = []
        for entry in entries:
            reason = (f"delivered {counts[entry.id]} times without an answer (max_deliveries "
                      f"{self.max_deliveries}): a worker crashed or hung on it each time")
            target = reply_target(entry.fields, self.rules)
            envelope = b""
            if target is not None:
                request_id, reply_key, content_type = target
                envelope = protocol.encode(protocol.error_envelope(
                    request_id, ErrorCode.DEAD_LETTER, reason), content_type)
            keys.append(self._reply_key(target[1] if target else "", entry.id, envelope,
                                        foreign))
            args += (entry.id, counts[entry.id], reason, envelope)
        if foreign and self.foreign is not None:
            self.foreign.push(self.stream, foreign)
        moved_ids, uncopied = self._move(keys=keys, args=args)
        if uncopied:
            wrong_type(self.model_name, "dead", self.dead_stream)
        moved = [as_text(m) for m in moved_ids]
        metrics.REQUESTS.labels(self.model_name, ErrorCode.DEAD_LETTER.value).inc(len(moved))
        metrics.DEAD_LETTERS.labels(self.model_name).inc(len(moved))
        log.warning("entries.dead_lettered", entry_ids=moved, dead_letter_stream=self.dead_stream)
        return moved

    def _reply_key(self, key: str, entry_id: str, envelope: bytes,
                   foreign: list[Reply]) -> str:
        """The reply key the script pushes to. On a cluster every key must be in the
        stream's slot: none is the stream itself (its LPUSH fails, so nothing is pushed),
        and a key in another slot is pushed once by ForeignReplies instead."""
        if self.foreign is None:
            return key
        if key and key_slot(key) != key_slot(self.stream):
            foreign.append(Reply(entry_id, key, envelope))
            return self.stream
        return key or self.stream


def list_dead_letters(client: redis.Redis, dead_stream: str, count: int) -> list[DeadLetter]:
    """The oldest `count` dead letters."""
    entries: Any = client.register_script(LIST)(keys=[dead_stream], args=[count])
    return [DeadLetter(as_text(entry_id), first_values(pairs)) for entry_id, pairs in entries]


def first_values(pairs: Sequence[bytes]) -> dict[str, str]:
    """Field name -> value, a repeated name's first value winning: the worker writes its
    dead:* metadata first, so one a producer added to its entry (before the copy skipped
    them) cannot shadow it."""
    fields: dict[str, str] = {}
    for name, value in zip(pairs[::2], pairs[1::2], strict=True):
        fields.setdefault(as_text(name, "replace"), as_text(value, "replace"))  # any bytes
    return fields


def requeue_dead_letters(client: redis.Redis, dead_stream: str, stream: str,
                         dead_ids: Sequence[str]) -> list[str]:
    """Put dead letters back on the request stream (atomically); returns the new entry ids."""
    if not dead_ids:
        return []
    added: Any = client.register_script(REQUEUE)(keys=[dead_stream, stream], args=list(dead_ids))
    return [as_text(a) for a in added]
