"""Reading the request stream through the consumer group.

Reads block with a timeout (never BLOCK 0: a half-open connection could hang forever), and
the client's socket timeout is longer than the block. A restarted worker first drains its
own pending entries (id 0), then reads new ones (id >). It drains them one at a time (the
worker runs each alone before the next): one of them may be the input that crashed the
previous process, and delivering it with others would count a delivery against them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

Fields = dict[bytes, bytes]


def is_group_lost(exc: redis.ResponseError) -> bool:
    """The stream or its group is gone (Redis restarted without persistence, or flushed);
    Redis 7 also ends a blocked read on a deleted stream with UNBLOCKED."""
    message = str(exc)  # inside a script, prefixed with "Error running script ..."
    return "NOGROUP" in message or message.startswith("UNBLOCKED")


@dataclass(slots=True)
class Entry:
    id: str
    fields: Fields | None  # None: the entry was deleted or trimmed while pending
    redelivered: bool = False  # delivered before (own pending, or claimed): may be poison
    default_reply: str | None = None  # on a Redis Cluster: the shard's default reply key


class StreamReader:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.draining_own_pending = True

    def ensure_group(self) -> None:
        """Create the group (and the stream) if missing; existing groups are kept."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` entries: this consumer's pending ones first, then new ones."""
        try:
            return self._read(count, block_ms)
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            self.ensure_group()  # Redis restarted without persistence, or was flushed
            return []

    def read_own_pending(self) -> list[Entry]:
        """One of this consumer's pending entries (no wait); none left ends the drain."""
        entries = self._guarded("0", 1, None)
        if not entries:
            self.draining_own_pending = False
        return entries

    def read_pending_after(self, after: str, count: int) -> list[Entry]:
        """Up to `count` of this consumer's pending entries with ids past `after` (no wait)."""
        return self._guarded(after, count, None)

    def read_new(self, count: int, block_ms: int) -> list[Entry]:
        """Up to `count` new entries, blocking up to `block_ms` (a shard's reader thread)."""
        return self._guarded(">", count, block_ms)

    def _guarded(self, start: str, count: int, block_ms: int | None) -> list[Entry]:
        try:
            return self._xreadgroup(start, count, block_ms)
        except redis.ResponseError as exc:
            if not is_group_lost(exc):
                raise
            self.ensure_group()
            return []

    def close(self) -> list[Entry]:
        """Entries read but not yet handed out: none here (the sharded reader has some)."""
        return []

    def _read(self, count: int, block_ms: int) -> list[Entry]:
        if self.draining_own_pending:
            entries = self._xreadgroup("0", 1, None)
            if entries:
                return entries
            self.draining_own_pending = False
        return self._xreadgroup(">", count, block_ms)

    def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[Entry]:
        response: Any = self.client.xreadgroup(self.group, self.consumer, {self.stream: start},
                                          count=count, block=block_ms)
        if not response:
            return []
        if isinstance(response, dict):  # RESP3 shape
            messages = next(iter(response.values()))[0]
        else:
            messages = response[0][1]
        return [Entry(as_text(entry_id), fields or None, start != ">")
                for entry_id, fields in messages]


def as_text(value: bytes | str, errors: str = "strict") -> str:
    """A name or id from a Redis reply: bytes, unless the client decodes responses."""
    return value.decode(errors=errors) if isinstance(value, bytes) else value
