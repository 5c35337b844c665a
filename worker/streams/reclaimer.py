"""Recovering the entries of consumers that died (or froze) and tidying up after them.

XAUTOCLAIM takes entries idle longer than `claim_idle_ms`; it scans at most COUNT x 10
pending entries per call and returns a cursor, which is followed rather than restarting at
0-0, so a long pending list is swept once instead of its head over and over. The claimed
entries go through the worker's normal admission and are re-batched. Should the slow owner
wake up, the replier's ownership check drops its late answer.
"""

from __future__ import annotations

import time
from typing import Any

import redis
import structlog

from worker.observe import metrics
from worker.streams.reader import Entry, as_text, is_group_lost

log = structlog.get_logger("redbatch.reclaimer")
START = "0-0"

CLAIM = """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] min idle ms, ARGV[4] cursor,
-- ARGV[5] count. Claimed entries that were deleted from the stream are acked: Redis 7 lists
-- their ids apart; 6.2 returns a bare nil in their place, so their ids are found among this
-- consumer's pending entries in the swept range. Returns {cursor, entries, deleted count}.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local r = redis.call('XAUTOCLAIM', stream, group, consumer, ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local entries, deleted = {}, r[3]
for _, entry in ipairs(r[2]) do
  if entry then entries[#entries + 1] = entry end
end
if not deleted then
  deleted = {}
  if #entries < #r[2] then
    local last = (r[1] == '0-0') and '+' or ('(' .. r[1])
    local swept = redis.call('XPENDING', stream, group, ARGV[4], last, 10 * ARGV[5], consumer)
    for _, row in ipairs(swept) do
      if #redis.call('XRANGE', stream, row[1], row[1]) == 0 then deleted[#deleted + 1] = row[1] end
    end
  end
end
if #deleted > 0 then redis.call('XACK', stream, group, unpack(deleted)) end
return {r[1], entries, #deleted}
"""

REMOVE_IDLE_CONSUMERS = """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] idle ms, ARGV[3] this consumer (kept).
-- Only consumers with nothing pending go: DELCONSUMER would drop their pending entries.
local removed = {}
for _, raw in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #raw, 2 do info[raw[i]] = raw[i + 1] end
  if info['pending'] == 0 and info['idle'] > tonumber(ARGV[2]) and info['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    removed[#removed + 1] = info['name']
  end
end
return removed
"""

RELEASE_CONSUMER = """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] this consumer. On a clean stop: delete the
-- consumer only when it holds nothing, checked in the same step, so no pending entry is lost.
-- Returns 1 when deleted, 0 when it still holds entries (they stay for others to claim).
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class Reclaimer:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str,
                 claim_idle_ms: int, model_name: str) -> None:
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.model_name = model_name
        self.interval_s = claim_idle_ms / 4000  # an idle entry waits at most 1.25 x the limit
        self.cursor = START
        self._next_sweep = time.monotonic() + self.interval_s
        self._claim = client.register_script(CLAIM)
        self._remove_idle = client.register_script(REMOVE_IDLE_CONSUMERS)
        self._release = client.register_script(RELEASE_CONSUMER)

    def due(self) -> bool:
        return time.monotonic() >= self._next_sweep

    def claim(self, count: int) -> list[Entry]:
        """Claim up to `count` idle entries, continuing the sweep where the last call ended."""
        try:
            result: Any = self._claim(keys=[self.stream], args=[
                self.group, self.consumer, self.claim_idle_ms, self.cursor, count])
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            self._restart_sweep()  # the reader recreates the group
            return []
        cursor, raw_entries, deleted = result
        self.cursor = as_text(cursor)
        if self.cursor == START:
            self._restart_sweep()  # swept the whole pending list: rest until the next round
        if deleted:
            metrics.UNANSWERABLE.labels(self.model_name, "deleted").inc(deleted)
        entries = [Entry(as_text(entry_id), _fields(fields), redelivered=True)
                   for entry_id, fields in raw_entries]
        if entries or deleted:
            metrics.RECLAIMED.labels(self.model_name).inc(len(entries))
            log.info("entries.claimed", count=len(entries), deleted=deleted)
        return entries

    def remove_idle_consumers(self, idle_ms: int) -> list[str]:
        """Remove consumers idle longer than `idle_ms` that hold nothing; returns their names."""
        try:
            removed: Any = self._remove_idle(keys=[self.stream],
                                             args=[self.group, idle_ms, self.consumer])
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return []
        names = [as_text(name) for name in removed]
        if names:
            log.info("consumers.removed", consumers=names)
        return names

    def release(self) -> bool:
        """Delete this consumer from the group if it holds nothing; True when it went."""
        try:
            released: Any = self._release(keys=[self.stream], args=[self.group, self.consumer])
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            return True  # no group, so no consumer left behind
        return bool(released)

    def _restart_sweep(self) -> None:
        self.cursor = START
        self._next_sweep = time.monotonic() + self.interval_s


def _fields(raw: list[bytes] | None) -> dict[bytes, bytes] | None:
    """A flat [field, value, ...] list as a dict; None for an entry deleted while pending."""
    if not raw:
        return None
    return dict(zip(raw[::2], raw[1::2], strict=True))
