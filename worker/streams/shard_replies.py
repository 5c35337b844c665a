"""Redis Cluster: replies per shard, and exactly one push to a reply key in another slot.

A reply key in the shard's slot (the default one, `<ns>:reply:{<m>:<s>}:<id>`) is written
with the ack by the shard's Replier, in one script, as on a single Redis. A client-chosen
`reply_to` in another slot lives on another node, where no script can see the shard's
pending list. It is written in two steps:

1. PUSH_ONCE, on the reply key's node: `SET NX PX` of an idempotence marker in the reply
   key's slot (protocol.reply_marker_key, named by the shard's stream and the entry id),
   and LPUSH + PEXPIRE only if the marker was new;
2. the shard's ownership-checked reply-and-ack script, acking that entry without a push.

A crash between the two leaves the entry pending: whoever answers it next finds the marker
and only acks. A frozen worker that wakes up after its entry was claimed finds the marker
of the claimant's push (or set it first, and the claimant's push is skipped): one push.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import structlog

from producer import connection, protocol
from producer.connection import ReplicaCount
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
            by_slot.setdefault(protocol.key_slot(reply.reply_key), []).append(reply)
        for group in by_slot.values():
            keys: list[str] = []
            for reply in group:
                keys += (protocol.reply_marker_key(self.namespace, reply.reply_key,
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
    """Answers for every shard: per shard the foreign pushes, then its reply-and-ack."""

    def __init__(self, repliers: Sequence[Replier], foreign: ForeignReplies) -> None:
        self.repliers = list(repliers)
        self.foreign = foreign
        self.slots = [protocol.key_slot(r.stream) for r in repliers]
        self.stream = repliers[0].stream
        # the replies of a call that failed on some shard, and what the others dropped: a
        # retry (RedisRetry passes the same list) writes only the shards not done yet
        self._partial: tuple[Sequence[Reply] | None, dict[int, list[str]]] = (None, {})
        self._retry_at: dict[int, float] = {}  # send_available: a failing shard's next try
        self._delays: dict[int, Iterator[float]] = {}
        self._faults: dict[int, Exception] = {}

    def send_available(self, replies: Sequence[Reply]) -> tuple[list[str], list[str]]:
        """Answer and ack on the shards whose master answers; (dropped ids, deferred ids).
        A shard whose master fails (killed, mid-failover) is deferred, and skipped until
        its backoff has passed, so the other shards' replies do not wait for it (the
        reply thread holds the deferred answers and sends them again)."""
        dropped: list[str] = []
        deferred: list[str] = []
        for shard, group in _per_shard(replies).items():
            if time.monotonic() < self._retry_at.get(shard, 0.0):
                deferred += (tagged(r.entry_id, shard) for r in group)
                continue
            if shard in self._faults:  # read the slot table again before the retry
                connection.follow_cluster(self.foreign.client, self._faults[shard])
            try:
                dropped += (tagged(d, shard) for d in self._send_shard(shard, group))
                for state in (self._delays, self._retry_at, self._faults):
                    state.pop(shard, None)
            except connection.CLUSTER_FAULTS as exc:
                delay = next(self._delays.setdefault(shard, backoff_delays()))
                self._retry_at[shard], self._faults[shard] = time.monotonic() + delay, exc
                deferred += (tagged(r.entry_id, shard) for r in group)
                log.warning("replies.deferred", shard=shard, error=str(exc),
                            retry_in_s=round(delay, 3))
        return dropped, deferred

    def next_retry_s(self) -> float:
        """How long until a deferred shard is due again (within [0.01, 2] s)."""
        due = min(self._retry_at.values(), default=0.0) - time.monotonic()
        return min(2.0, max(0.01, due))

    def send(self, replies: Sequence[Reply]) -> list[str]:
        """Answer and ack; returns the (tagged) entry ids dropped as no longer ours. A
        fault on one shard is raised after the other shards were written."""
        per_shard = _per_shard(replies)
        if self._partial[0] is not replies:  # not a retry of the call that failed
            self._partial = (replies, {})
        done, fault = self._partial[1], None
        for shard, group in per_shard.items():
            if shard in done:  # a retry skips the shards written before the fault
                continue
            try:
                done[shard] = [tagged(d, shard) for d in self._send_shard(shard, group)]
            except redis.RedisError as exc:  # the other shards' masters may be fine
                fault = fault or exc
        if fault is not None:
            raise fault
        self._partial = (None, {})
        return [d for dropped in done.values() for d in dropped]

    def _send_shard(self, shard: int, group: list[Reply]) -> list[str]:
        replier = self.repliers[shard]
        foreign = [r for r in group if protocol.key_slot(r.reply_key) != self.slots[shard]]
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


def _per_shard(replies: Sequence[Reply]) -> dict[int, list[Reply]]:
    """Replies grouped by shard, with their streams' own entry ids."""
    per_shard: dict[int, list[Reply]] = {}
    for reply in replies:
        raw, shard = untagged(reply.entry_id)
        per_shard.setdefault(shard, []).append(Reply(raw, reply.reply_key, reply.envelope))
    return per_shard
