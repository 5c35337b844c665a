"""Ids in flight: a marker per (reply key, request id) names the entry that serves it.

Two entries with one id and one reply key would write into one answer (a list reply read
by the wrong client, two generations interleaved on one reply stream). At read time each
entry sets its marker (`SET NX PX result_ttl_ms`, the reply's own lifetime); an entry that
finds the marker held by another entry is answered `duplicate_id` instead of being served.
A redelivered entry finds its own marker and is served again, as before. On a single Redis
the whole read is one script; on a Cluster the markers live in many slots, so they are one
pipeline of `SET NX`, and a `GET` of those already set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer import connection, protocol
from worker.streams.reader import as_text

CLAIM_IDS = """
-- KEYS: the markers; ARGV[1] ttl ms, then the entry id of each marker.
-- Returns the (1-based) positions of the markers another entry holds.
local taken = {}
for i = 1, #KEYS do
  local entry = ARGV[i + 1]
  if not redis.call('SET', KEYS[i], entry, 'NX', 'PX', ARGV[1]) then
    if redis.call('GET', KEYS[i]) ~= entry then taken[#taken + 1] = i end
  end
end
return taken
"""


@dataclass(frozen=True, slots=True)
class Claim:
    """An entry's claim on its request id, on the reply key it would be answered on."""

    entry_id: str
    request_id: str
    reply_to: str


class IdClaims:
    """Claims request ids for the entries of one read."""

    def __init__(self, client: Any, namespace: str, ttl_ms: int) -> None:
        self.client, self.namespace, self.ttl_ms = client, namespace, ttl_ms
        self._cluster = connection.is_cluster_client(client)
        self._claim = None if self._cluster else client.register_script(CLAIM_IDS)

    def taken(self, claims: Sequence[Claim]) -> set[str]:
        """The entry ids whose request id another entry holds on the same reply key."""
        if not claims:
            return set()
        keys = [protocol.inflight_key(self.namespace, c.reply_to, c.request_id)
                for c in claims]
        if self._claim is not None:
            positions = self._claim(keys=keys, args=[self.ttl_ms, *(c.entry_id for c in claims)])
            return {claims[int(p) - 1].entry_id for p in positions}
        return self._taken_on_cluster(keys, claims)

    def _taken_on_cluster(self, keys: list[str], claims: Sequence[Claim]) -> set[str]:
        pipe = self.client.pipeline(transaction=False)
        for key, claim in zip(keys, claims, strict=True):
            pipe.set(key, claim.entry_id, nx=True, px=self.ttl_ms)
        unset = [i for i, done in enumerate(pipe.execute()) if not done]
        if not unset:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for i in unset:
            pipe.get(keys[i])
        holders = pipe.execute()
        return {claims[i].entry_id for i, holder in zip(unset, holders, strict=True)
                if holder is not None and as_text(holder) != claims[i].entry_id}

    def release(self, claims: Sequence[Claim]) -> None:
        """Drop markers (dead letters put back on the stream come with new entry ids)."""
        keys = [protocol.inflight_key(self.namespace, c.reply_to, c.request_id)
                for c in claims]
        if keys:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(key)
            pipe.execute()
