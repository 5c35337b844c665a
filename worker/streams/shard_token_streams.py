"""Redis Cluster: a generative model's reply streams, per shard.

A request of shard s streams by default to `<ns>:stream:{<m>:<s>}:<id>`
(protocol.token_stream_key of its shard's default reply key), in the shard's slot: its
chunks, and the `done` entry written with the XACK in one ownership-checked script by the
shard's TokenStreams, as on a single Redis. A client-chosen `reply_to` stream in another
slot lives on another node, so its done entry is written in two steps, as list replies are
(streams/shard_replies.py):

1. DONE_ELSEWHERE, on the reply stream's node: the done entry at its explicit id `<n>-1`
   (XADD refuses it if it is there already, so a second write is never seen);
2. the shard's FINISH_AND_ACK, acking the entry without a write.

A crash between the two leaves the entry pending; whoever takes it over reads the stream,
finds the done entry and only acks. Chunks and the cancel check go through the cluster
client's pipeline (one batch per node); keep-alive claims run per shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.shards import key_slot
from worker.streams.shards import by_shard, tagged, untagged
from worker.streams.token_streams import (
    APPEND_DONE,
    Chunk,
    FinalChunk,
    Progress,
    TokenStreams,
)

DONE_ELSEWHERE = APPEND_DONE + """
-- KEYS: reply streams, all in one slot; ARGV[1] ttl ms, then pairs: chunk id, data
for i = 1, #KEYS do
  local refused = append_done(KEYS[i], ARGV[2 * i], ARGV[2 * i + 1], ARGV[1])
  if refused then return redis.error_reply(refused.err) end
end
return #KEYS
"""


class ShardedTokenStreams:
    """TokenStreams' calls for every shard (tagged entry ids `<id>@<shard>`)."""

    def __init__(self, shards: Sequence[TokenStreams], ttl_ms: int) -> None:
        self.shards = list(shards)
        self.ttl_ms = ttl_ms
        self.slots = [key_slot(s.stream) for s in shards]
        self.client: Any = shards[0].client
        self._done_elsewhere = self.client.register_script(DONE_ELSEWHERE)

    def progress(self, keys: Sequence[str], max_tokens: Sequence[int]) -> list[Progress]:
        return self.shards[0].progress(keys, max_tokens)  # XRANGEs through the cluster pipeline

    def write(self, chunks: Sequence[Chunk], cancel_keys: Sequence[str] = ()) -> list[bool]:
        return self.shards[0].write(chunks, cancel_keys)

    def keep_alive(self, entry_ids: Sequence[str]) -> list[str]:
        lost: list[str] = []
        for shard, raw_ids in by_shard(entry_ids).items():
            lost += (tagged(i, shard) for i in self.shards[shard].keep_alive(raw_ids))
        return lost

    def finish(self, finals: Sequence[FinalChunk]) -> list[str]:
        """Per shard: done entries in other slots first (step 1), then the shard's
        script writes its own and acks them all; returns the dropped (tagged) ids."""
        per_shard: dict[int, list[FinalChunk]] = {}
        for final in finals:
            raw, shard = untagged(final.entry_id)
            per_shard.setdefault(shard, []).append(FinalChunk(raw, final.chunk))
        dropped: list[str] = []
        for shard, group in per_shard.items():
            foreign = [f for f in group if key_slot(f.chunk.key) != self.slots[shard]]
            self._write_elsewhere([f.chunk for f in foreign])
            ack_only = {id(f) for f in foreign}
            group = [FinalChunk(f.entry_id, Chunk(self.shards[shard].stream, 0, b""))
                     if id(f) in ack_only else f for f in group]
            dropped += (tagged(d, shard) for d in self.shards[shard].finish(group))
        return dropped

    def _write_elsewhere(self, chunks: Sequence[Chunk]) -> None:
        """Step 1: one script call per slot of the reply streams."""
        by_slot: dict[int, list[Chunk]] = {}
        for chunk in chunks:
            by_slot.setdefault(key_slot(chunk.key), []).append(chunk)
        for group in by_slot.values():
            args: list[Any] = [self.ttl_ms]
            for chunk in group:
                args += (f"{chunk.index}-1", chunk.data)
            self._done_elsewhere(keys=[c.key for c in group], args=args)
