"""Redis Cluster: replies per shard, and exactly one push to a reply key in another slot.

A reply key in the shard's slot (the default one, `<ns>:reply:{<m>:<s>}:<id>`) is written
with the ack by the shard's Replier, in one script, as on a single Redis. A client-chosen
`reply_to` in another slot lives on another node, where no script can see the shard's
pending list. It is written in two steps:

1. PUSH_ONCE, on the reply key's node: `SET NX PX` of an idempotence marker in the reply
   key's slot (reply_marker_key, named by the shard's stream and the entry id),
   and LPUSH + PEXPIRE only if the marker was new;
2. the shard's ownership-checked reply-and-ack script, acking that entry without a push.

A crash between the two leaves the entry pending: whoever answers it next finds the marker
and only acks. A frozen worker that wakes up after its entry was claimed finds the marker
of the claimant's push (or set it first, and the claimant's push is skipped): one push.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
import structlog

from producer import connection
from producer.replicas import ReplicaCount
from producer.shards import key_slot, reply_marker_key
from worker.observe import metrics
from worker.policy.backoff import backoff_delays
from worker.streams.replier import Replier, Reply, script_then_wait
from worker.streams.shards import by_shard, tagged, untagged

log = structlog.get_logger("redbatch.replier")

PUSH_ONCE = """
-- KEYS: per reply a marker and its reply key, all in one slot; ARGV[1] reply ttl ms,
-- ARGV[2] marker ttl ms, then the envelopes. Returns the (1-based) replies not delivered
-- because their key holds another type than a list (acked all the same).
local undeliverable, expiring = {}, {}
for i = 1, #KEYS / 2 do
  local marker, key = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('SET', marker, '1', 'NX', 'PX', ARGV[2]) then
    local pushed = redis.pcall('LPUSH', key, ARGV[i + 2])
    if type(pushed) == 'table' and pushed.err then
      if not string.find(pushed.err, 'WRONGTYPE', 1, true) then
        return redis.error_reply(pushed.err)
      end
      undeliverable[#undeliverable + 1] = i
    elseif not expiring[key] then
      redis.call('PEXPIRE', key, ARGV[1])
      expiring[key] = true
    end
  end
end
return undeliverable
"""


class ForeignReplies:
    """Step 1 above, grouped by the reply keys' slot: one script call per slot (and, when
    replicas are wanted, its WAIT on the same connection to that slot's master)."""

    def __init__(self, client: Any, namespace: str, ttl_ms: int, model_name: str,
                 replicas: ReplicaCount) -> None:
        self.client = client
        self.namespace = namespace
        self.ttl_ms = ttl_ms
        self.model_name = model_name
        self.replicas = replicas  # the setting; one count per node is kept from it
        self._per_node: dict[str, ReplicaCount] = {}
        self._script = client.register_script(PUSH_ONCE)

    def push(self, stream: str, replies: Sequence[Reply]) -> None:
        """Push each reply once (replies carry the stream's own entry ids)."""
        by_slot: dict[int, list[Reply]] = {}
        for reply in replies:
            by_slot.setdefault(key_slot(reply.reply_key), []).append(reply)
        for group in by_slot.values():
            keys: list[str] = []
            for reply in group:
                keys += (reply_marker_key(self.namespace, reply.reply_key,
                                                   f"{stream}:{reply.entry_id}"), reply.reply_key)
            undeliverable = self._write(keys, [self.ttl_ms, self.ttl_ms,
                                               *(r.envelope for r in group)])
            if undeliverable:
                metrics.UNANSWERABLE.labels(self.model_name, "reply_key_type").inc(
                    len(undeliverable))
                log.warning("replies.undeliverable", reason="reply key is not a list",
                            entry_ids=[group[int(i) - 1].entry_id for i in undeliverable])

    def _write(self, keys: list[str], args: list[Any]) -> list[int]:
        node = connection.node_client(self.client, keys[1])
        replicas = self._replicas(node)
        wanted = replicas.count(node)
        if not wanted:
            result: list[int] = self._script(keys=keys, args=args)
            return result
        try:
            result, acked = script_then_wait(node, self._script, keys, args, wanted,
                                             replicas.timeout_ms)
        except connection.CLUSTER_FAULTS as exc:
            connection.follow_cluster(self.client, exc)
            if isinstance(exc, redis.exceptions.MovedError):
                raise redis.exceptions.TryAgainError(str(exc)) from exc  # RedisRetry retries
            raise
        if acked < wanted:
            metrics.REPLICATION_SHORT.labels(self.model_name).inc()
            replicas.short()
        return result

    def _replicas(self, node: Any) -> ReplicaCount:
        """Each master has its own replicas: one count per node, from the setting."""
        where = node.connection_pool.connection_kwargs
        return self._per_node.setdefault(f"{where.get('host')}:{where.get('port')}",
                                         ReplicaCount(self.replicas.configured,
                                                      self.replicas.timeout_ms))


class ShardedReplier:
    """Answers for every shard: per shard the foreign pushes, then its reply-and-ack.

    The shards are written at the same time, each in its own thread (the first in the
    caller's): a shard's write is a round trip to its master, and with replicas_to_wait one
    that lasts until a replica acknowledged it (WAIT), so one after another they added up.
    Threads, not one thread sending every pipeline before reading any: each shard keeps the
    plain redis-py calls of Replier and ForeignReplies on its own node connection, with
    their fault handling (MOVED, ASK, NOSCRIPT, a connection lost mid-reply) unchanged; the
    socket waits release the GIL. A shard's own steps (foreign push, then ack) stay in order.
    """

    def __init__(self, repliers: Sequence[Replier], foreign: ForeignReplies) -> None:
        self.repliers = list(repliers)
        self.foreign = foreign
        self.slots = [key_slot(r.stream) for r in repliers]
        self.stream = repliers[0].stream
        self.defers = True  # a shard whose master fails is held back (send_available)
        # the replies of a call that failed on some shard, and what the others dropped: a
        # retry (RedisRetry passes the same list) writes only the shards not done yet
        self._partial: tuple[Sequence[Reply] | None, dict[int, list[str]]] = (None, {})
        self._retry_at: dict[int, float] = {}  # send_available: a failing shard's next try
        self._delays: dict[int, Iterator[float]] = {}
        self._faults: dict[int, Exception] = {}
        self._pool = ThreadPoolExecutor(max(1, len(self.repliers) - 1),
                                        thread_name_prefix="redbatch-shard-reply")

    def send_available(self, replies: Sequence[Reply]) -> tuple[list[str], list[str]]:
        """Answer and ack on the shards whose master answers; (dropped ids, deferred ids).
        A shard whose master fails (killed, mid-failover) is deferred, and skipped until
        its backoff has passed, so the other shards' replies do not wait for it (the
        reply thread holds the deferred answers and sends them again). Another fault is
        raised once every shard was tried."""
        deferred: list[str] = []
        due: dict[int, list[Reply]] = {}
        for shard, group in _per_shard(replies).items():
            if time.monotonic() < self._retry_at.get(shard, 0.0):
                deferred += (tagged(r.entry_id, shard) for r in group)
                continue
            due[shard] = group
            if shard in self._faults:  # read the slot table again before the retry
                connection.follow_cluster(self.foreign.client, self._faults[shard])
        done, faults = self._write(replies, due)
        for shard, group in due.items():
            fault = faults.get(shard)
            if fault is None:
                for state in (self._delays, self._retry_at, self._faults):
                    state.pop(shard, None)
            elif isinstance(fault, connection.CLUSTER_FAULTS):
                self._defer(shard, fault)
                deferred += (tagged(r.entry_id, shard) for r in group)
        others = {s: f for s, f in faults.items() if not isinstance(f, connection.CLUSTER_FAULTS)}
        if others:
            raise _first(others)
        self._partial = (None, {})
        return [d for dropped in done.values() for d in dropped], deferred

    def _defer(self, shard: int, fault: Exception) -> None:
        delay = next(self._delays.setdefault(shard, backoff_delays()))
        self._retry_at[shard], self._faults[shard] = time.monotonic() + delay, fault
        log.warning("replies.deferred", shard=shard, error=str(fault),
                    retry_in_s=round(delay, 3))

    def next_retry_s(self) -> float:
        """How long until a deferred shard is due again (within [0.01, 2] s)."""
        due = min(self._retry_at.values(), default=0.0) - time.monotonic()
        return min(2.0, max(0.01, due))

    def send(self, replies: Sequence[Reply]) -> list[str]:
        """Answer and ack; returns the (tagged) entry ids dropped as no longer ours. A
        fault on one shard is raised after the other shards were written."""
        done, faults = self._write(replies, _per_shard(replies))
        if faults:
            raise _first(faults)
        self._partial = (None, {})
        return [d for dropped in done.values() for d in dropped]

    def _write(self, replies: Sequence[Reply], due: dict[int, list[Reply]]
               ) -> tuple[dict[int, list[str]], dict[int, Exception]]:
        """Every due shard written at once, but those that a failed call with the same
        replies wrote (a retry must not answer them again, and their dropped ids are kept):
        (dropped ids of every shard written, the fault of each shard that failed)."""
        if self._partial[0] is not replies:  # not a retry of the call that failed
            self._partial = (replies, {})
        done = self._partial[1]
        todo = [(shard, group) for shard, group in due.items() if shard not in done]
        futures = [(s, self._pool.submit(self._attempt, s, g)) for s, g in todo[1:]]
        outcomes = [(s, self._attempt(s, g)) for s, g in todo[:1]]  # meanwhile, here
        outcomes += ((s, future.result()) for s, future in futures)
        faults: dict[int, Exception] = {}
        for shard, outcome in outcomes:
            if isinstance(outcome, Exception):
                faults[shard] = outcome
            else:
                done[shard] = outcome
        return done, faults

    def _attempt(self, shard: int, group: list[Reply]) -> list[str] | Exception:
        """One shard's write (in a pool thread): its tagged dropped ids, or its fault."""
        try:
            return [tagged(d, shard) for d in self._send_shard(shard, group)]
        except Exception as exc:  # handed to the caller, which raises or defers it
            return exc

    def _send_shard(self, shard: int, group: list[Reply]) -> list[str]:
        replier = self.repliers[shard]
        foreign = [r for r in group if key_slot(r.reply_key) != self.slots[shard]]
        if foreign:
            self.foreign.push(replier.stream, foreign)
            ack_only = {id(r) for r in foreign}
            group = [Reply(r.entry_id, replier.stream, b"") if id(r) in ack_only else r
                     for r in group]
        return replier.send(group)

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Ack entries that cannot be answered, on their shards."""
        for shard, raw_ids in by_shard(entry_ids).items():
            self.repliers[shard].ack(raw_ids)


def _first(faults: dict[int, Exception]) -> Exception:
    """The fault to raise: a bug before a Redis fault, else the first shard's."""
    bugs = [f for f in faults.values() if not isinstance(f, redis.RedisError)]
    return (bugs or list(faults.values()))[0]


def _per_shard(replies: Sequence[Reply]) -> dict[int, list[Reply]]:
    """Replies grouped by shard, with their streams' own entry ids."""
    per_shard: dict[int, list[Reply]] = {}
    for reply in replies:
        raw, shard = untagged(reply.entry_id)
        per_shard.setdefault(shard, []).append(Reply(raw, reply.reply_key, reply.envelope))
    return per_shard
