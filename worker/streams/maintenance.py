"""Periodic upkeep of a stream: trim what every group has acked, export the backlog, remove
consumers that left, and announce this worker (its layout, for `stats`). Every worker runs
it; each step is one atomic script or transaction, so running it in many workers at once is
harmless. A failing step is logged and tried again next period.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import structlog

from producer.backlog import BACKLOG
from worker.observe import metrics
from worker.streams.reader import as_text
from worker.streams.reclaimer import Reclaimer
from worker.streams.replier import wrong_type

log = structlog.get_logger("redbatch.maintenance")
BACKLOG_GAUGE_CAP = 100_000  # Redis < 7 counts undelivered entries one by one: bound the cost

TRIM_ACKED = """
-- KEYS[1] stream. Trims (XTRIM MINID) below the oldest entry that some group has not acked:
-- the smallest pending id or the first entry after last-delivered-id, over all groups.
-- Computed and applied in one step, so no entry still to be answered is ever trimmed.
-- Returns the number of entries trimmed.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local function older(a, b)
  local ams, aseq = string.match(a, '(%d+)-(%d+)')
  local bms, bseq = string.match(b, '(%d+)-(%d+)')
  ams, bms = tonumber(ams), tonumber(bms)
  return ams < bms or (ams == bms and tonumber(aseq) < tonumber(bseq))
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end  -- nobody consumes yet: keep everything
local keep = nil
for _, raw in ipairs(groups) do
  local info = {}
  for i = 1, #raw, 2 do info[raw[i]] = raw[i + 1] end
  local candidates = {}
  if info['pending'] > 0 then
    candidates[1] = redis.call('XPENDING', KEYS[1], info['name'])[2]
  end
  local undelivered = redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+',
                                 'COUNT', 1)
  if #undelivered == 1 then candidates[#candidates + 1] = undelivered[1][1] end
  for _, id in ipairs(candidates) do
    if keep == nil or older(id, keep) then keep = id end
  end
end
if keep == nil then return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0) end
return redis.call('XTRIM', KEYS[1], 'MINID', keep)
"""


ANNOUNCE_TTL_INTERVALS = 10  # the workers hash outlives the last worker by this many periods


def registry_entry(described: Mapping[str, Any]) -> str:
    """A model's value in the registry (protocol.models_key): when a worker of it was last
    seen, and its kind."""
    return json.dumps({"seen_ms": described["seen_ms"], "kind": described.get("kind")})


class Maintenance:
    def __init__(self, client: redis.Redis, stream: str, group: str, model_name: str,
                 reclaimer: Reclaimer, interval_s: float, consumer_idle_ms: int,
                 describe: Callable[[], Mapping[str, Any]] | None = None,
                 workers_key: str | None = None, models_key: str | None = None,
                 internal_keys: Mapping[str, str] | None = None) -> None:
        """`describe`: what `stats` shows of this worker, kept under `workers_key`; the
        model's entry in the registry `models_key` is refreshed with it; `internal_keys`:
        key -> the type redbatch keeps there, checked at start."""
        self.client = client
        self.stream = stream
        self.group = group
        self.model_name = model_name
        self.reclaimer = reclaimer
        self.interval_s = interval_s
        self.consumer_idle_ms = consumer_idle_ms
        self.describe = describe or dict
        self.workers_key = workers_key
        self.models_key = models_key
        self.internal_keys = dict(internal_keys or {})
        self._trim = client.register_script(TRIM_ACKED)
        self._backlog = client.register_script(BACKLOG)

    def run(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.interval_s):
            try:
                self.run_once()
            except redis.RedisError as exc:
                log.warning("maintenance.failed", error=str(exc))

    def run_once(self) -> None:
        trimmed = self.trim()
        if trimmed:
            log.debug("stream.trimmed", entries=trimmed)
        metrics.BACKLOG.labels(self.model_name).set(self.backlog())
        removed = self.reclaimer.remove_idle_consumers(self.consumer_idle_ms)
        self.announce(gone=removed)

    def announce(self, gone: list[str] | None = None) -> None:
        """Write this worker's description and its model's registry entry, and forget
        consumers that left, in one transaction. `seen_ms` tells the gateway this worker is
        alive even while it reads nothing: before Redis 7.2, XINFO CONSUMERS' `idle` counts
        only reads that delivered entries."""
        if self.workers_key is None:
            return
        described = {**self.describe(), "seen_ms": int(time.time() * 1000)}
        pipe = self.client.pipeline(transaction=True)
        self._describe_in(pipe, described, gone)
        if self.models_key is not None:
            pipe.hset(self.models_key, self.model_name, registry_entry(described))
        self._tolerating_wrong_types(pipe.execute)

    def leave(self) -> bool:
        """On a clean stop: delete this worker's consumer where it holds nothing, and its
        announcement, so `stats` and the gateway stop listing it at once. Returns whether
        it left; a consumer still holding entries stays (and so does its announcement)."""
        released = all([reclaimer.release() for reclaimer in self.reclaimers()])
        if released and self.workers_key is not None:
            self._tolerating_wrong_types(
                lambda: self.client.hdel(self.workers_key or "", self.reclaimer.consumer))
        return released

    def reclaimers(self) -> list[Reclaimer]:
        """This worker's reclaimer on each stream it reads (one, or one per shard)."""
        return [self.reclaimer]

    def _tolerating_wrong_types(self, write: Callable[[], Any]) -> None:
        """A workers hash or registry squatted by another type skips the announcement
        (logged and counted): the worker serves on."""
        try:
            write()
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            wrong_type(self.model_name, "workers", f"{self.workers_key} or {self.models_key}")

    def check_keys(self) -> None:
        """Name, one line each, the internal keys that hold another type than redbatch
        writes there: their writes are skipped (and counted) while they do."""
        if not self.internal_keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in self.internal_keys:
            pipe.type(key)
        for (key, expected), found in zip(self.internal_keys.items(), pipe.execute(),
                                          strict=True):
            if as_text(found) not in ("none", expected):
                log.warning("internal_key.wrong_type", key=key, holds=as_text(found),
                            expected=expected, hint="delete it: redbatch recreates it")

    def _describe_in(self, pipe: Any, described: Mapping[str, Any],
                     gone: list[str] | None) -> None:
        """The workers hash's part of an announcement, queued on `pipe`."""
        assert self.workers_key is not None
        pipe.hset(self.workers_key, self.reclaimer.consumer, json.dumps(described))
        if gone:
            pipe.hdel(self.workers_key, *gone)
        pipe.pexpire(self.workers_key,
                     int(self.interval_s * 1000 * ANNOUNCE_TTL_INTERVALS) + self.consumer_idle_ms)

    def trim(self) -> int:
        """Drop the entries every group has acked; returns how many went."""
        trimmed: Any = self._trim(keys=[self.stream])
        return int(trimmed)

    def backlog(self) -> int:
        """Entries the group has not acked yet (pending plus undelivered)."""
        backlog: Any = self._backlog(keys=[self.stream], args=[self.group, BACKLOG_GAUGE_CAP])
        return int(backlog)
