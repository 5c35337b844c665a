"""A consumer group's backlog, and enqueueing only while it is under a limit.

Backlog = entries not yet acked by the group: the pending ones (read, not yet answered)
plus those not yet delivered. Redis 7 reports the second figure as `lag`; on 6.2 (or when
Redis 7 cannot tell) the entries after the group's last-delivered id are counted, at most
`cap` of them, so the check stays bounded. The check and the XADDs run in one Lua script,
so a flood of producers cannot race past the limit.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from producer.shards import default_shards, shards_key

BACKLOG_FUNCTION = """
local function backlog(stream, group, cap)
  if redis.call('EXISTS', stream) == 0 then return 0 end
  for _, raw in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #raw, 2 do info[raw[i]] = raw[i + 1] end
    if info['name'] == group then
      if type(info['lag']) == 'number' then return info['pending'] + info['lag'] end
      local undelivered = redis.call('XRANGE', stream, '(' .. info['last-delivered-id'], '+',
                                     'COUNT', cap)
      return info['pending'] + #undelivered
    end
  end
  return redis.call('XLEN', stream)  -- no worker has created the group yet: all waits
end
"""

BACKLOG = BACKLOG_FUNCTION + """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] cap on the entries counted one by one
return backlog(KEYS[1], ARGV[1], tonumber(ARGV[2]))
"""

ADD_IF_UNDER = BACKLOG_FUNCTION + """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] max backlog, then per entry: field count, pairs.
-- All entries are added, or none when they would take the backlog past the limit.
-- Returns {1, id...} when added, {0, backlog} when refused.
local stream, group, limit = KEYS[1], ARGV[1], tonumber(ARGV[2])
local entries, i = {}, 3
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  entries[#entries + 1] = {unpack(ARGV, i + 1, i + 2 * n)}
  i = i + 1 + 2 * n
end
local current = backlog(stream, group, limit + 1)
if current + #entries > limit then return {0, current} end
local ids = {1}
for _, fields in ipairs(entries) do
  ids[#ids + 1] = redis.call('XADD', stream, '*', unpack(fields))
end
return ids
"""


def add_arguments(group: str, max_backlog: int,
                  entries: list[dict[str, str | bytes | int]]) -> list[str | bytes | int]:
    """The ARGV of ADD_IF_UNDER for these entries' fields."""
    args: list[str | bytes | int] = [group, max_backlog]
    for fields in entries:
        args.append(len(fields))
        for name, value in fields.items():
            args += (name, value)
    return args


ADD_ONCE = BACKLOG_FUNCTION + """
-- KEYS[1] stream, KEYS[2..n+1] the entries' request markers (<namespace>:submitted:<id>)
-- ARGV[1] group, ARGV[2] max backlog (-1: no limit), ARGV[3] marker ttl ms, then per entry:
-- field count, pairs. An entry whose marker exists was added before (this is a resubmission,
-- after a short WAIT or a lost connection) and is skipped; the others are added all, or
-- none when they would take the backlog past the limit. Marker and entry are written by
-- this one script, so they replicate together: a new master has both or neither.
-- Returns {1, added count} when added, {0, backlog} when refused.
local stream, group, limit, ttl = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local fresh, i, k = {}, 4, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  if redis.call('EXISTS', KEYS[k]) == 0 then
    fresh[#fresh + 1] = {KEYS[k], {unpack(ARGV, i + 1, i + 2 * n)}}
  end
  i, k = i + 1 + 2 * n, k + 1
end
if limit >= 0 and #fresh > 0 then
  local current = backlog(stream, group, limit + 1)
  if current + #fresh > limit then return {0, current} end
end
for _, entry in ipairs(fresh) do
  redis.call('SET', entry[1], '1', 'NX', 'PX', ttl)
  redis.call('XADD', stream, '*', unpack(entry[2]))
end
return {1, #fresh}
"""


def submitted_key(namespace: str, request_id: str) -> str:
    """The marker ADD_ONCE leaves for a request id, so a resubmission adds nothing."""
    return f"{namespace}:submitted:{request_id}"


def add_once_arguments(group: str, max_backlog: int | None, marker_ttl_ms: int,
                       entries: list[dict[str, str | bytes | int]]) -> list[str | bytes | int]:
    """The ARGV of ADD_ONCE for these entries' fields."""
    args = add_arguments(group, -1 if max_backlog is None else max_backlog, entries)
    return [*args[:2], marker_ttl_ms, *args[2:]]


class ShardCycle:
    """Cluster mode: the shard the next requests go to, round-robin from a random start
    (so producers started together do not all begin on shard 0). `after(s)` is the order
    to try when shard s is over its share of max_backlog: s, s+1, ... around once."""

    def __init__(self, count: int, start: int | None = None) -> None:
        if count < 1:
            raise ValueError("a sharded queue has at least one shard")
        self.count = count
        self._next = random.randrange(count) if start is None else start % count
        self._lock = threading.Lock()  # one Client may be shared by threads

    def take(self, n: int = 1) -> list[int]:
        """The shards of the next `n` requests."""
        with self._lock:
            first, self._next = self._next, (self._next + n) % self.count
        return [(first + i) % self.count for i in range(n)]

    def after(self, shard: int) -> list[int]:
        return [(shard + i) % self.count for i in range(self.count)]

    def spread(self, n: int) -> dict[int, list[int]]:
        """The indices 0..n-1 of a batch of requests, grouped by the shard each goes to."""
        groups: dict[int, list[int]] = {}
        for index, shard in enumerate(self.take(n)):
            groups.setdefault(shard, []).append(index)
        return groups

    def share(self, max_backlog: int) -> int:
        """One shard's part of max_backlog (rounded up), so all shards hold at most about
        max_backlog together."""
        return -(-max_backlog // self.count)


def published_shards(value: bytes | str | None) -> int | None:
    """The shard count a `redbatch:shards:<model>` GET returned, or None."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    return int(text) if text.isdigit() and int(text) > 0 else None


def shard_count(client: Any, namespace: str, model: str, wanted: int = 0) -> int:
    """The model's shard count on a cluster: the published one, or (first comer) `wanted`,
    by default 2 x the masters, published with SET NX so every producer and worker agrees."""
    key = shards_key(namespace, model)
    count = published_shards(client.get(key))
    if count is None:
        client.set(key, wanted or default_shards(len(client.get_primaries())), nx=True)
        count = published_shards(client.get(key))
    if count is None:
        raise ValueError(f"{key} does not hold a shard count")
    return count
