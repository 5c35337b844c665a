"""Reading a generative model's reply stream (`<ns>:stream:<id>`, docs/protocol.md): XREAD
from 0-0, then from the last entry id seen, until the `done` entry.

A broken connection mid-stream (a failover, a killed client connection) is not the end: the
reader reconnects and reads on from the last id it saw, so no chunk comes twice and none is
missed. Each entry's envelope must carry the request's id; others are dropped and counted
(anyone may write to a key named after a request's id).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgpack
import redis

from producer.errors import ResultTimeout, unwrap

READ_COUNT = 100  # entries per XREAD
RECONNECTS = 5  # broken connections in a row before the error is raised
RECONNECT_DELAY_S = 0.05
BROKEN = (redis.ConnectionError, redis.TimeoutError)


def decode_chunk(data: Any) -> dict[str, Any] | None:
    """A stream entry's envelope (JSON or msgpack), or None when unreadable."""
    if not isinstance(data, bytes):
        return None
    try:
        value = json.loads(data) if data[:1] == b"{" else msgpack.unpackb(
            data, raw=False, strict_map_key=False)
    except Exception:  # json and msgpack raise several types
        return None
    return value if isinstance(value, dict) else None


class StreamReading:
    """Where a reader is in one request's stream: the last entry id, and the end."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.last = "0-0"
        self.done: dict[str, Any] | None = None
        self.foreign = 0  # entries that answer another id (dropped)

    def take(self, batch: Iterable[Any]) -> list[str]:
        """The deltas' text in `batch` (XREAD entries), in order; records the `done` entry."""
        texts = []
        for entry_id, fields in batch:
            self.last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            envelope = decode_chunk(fields.get(b"data", fields.get("data")))
            if envelope is None or envelope.get("id") != self.request_id:
                self.foreign += 1
                continue
            if envelope.get("type") == "done":
                self.done = envelope
                break
            if isinstance(envelope.get("text"), str):
                texts.append(envelope["text"])
        return texts

    def final(self) -> Any:
        """The result of the `done` envelope, or RequestFailed."""
        assert self.done is not None
        return unwrap({**self.done, "ok": bool(self.done.get("ok"))})


def read_stream(client: redis.Redis, key: str, reading: StreamReading,
                slices: Iterable[float]) -> Iterator[str]:
    """Yield the deltas' text until the `done` entry (then `reading.done` is set);
    ResultTimeout when `slices` (XREAD block times, s) run out first."""
    broken = 0
    for block_s in slices:
        try:
            found: Any = client.xread({key: reading.last}, count=READ_COUNT,
                                      block=max(1, int(block_s * 1000)))
        except BROKEN:
            broken += 1
            if broken > RECONNECTS:
                raise
            time.sleep(RECONNECT_DELAY_S * broken)  # the next command reconnects
            continue
        broken = 0
        for _, batch in found or []:
            yield from reading.take(batch)
        if reading.done is not None:
            return
    raise ResultTimeout(f"no end of the answer to {reading.request_id} on {key} in time")


async def read_stream_async(client: Any, key: str, reading: StreamReading,
                            slices: Iterable[float]) -> AsyncIterator[str]:
    """read_stream for asyncio."""
    broken = 0
    for block_s in slices:
        try:
            found: Any = await client.xread({key: reading.last}, count=READ_COUNT,
                                            block=max(1, int(block_s * 1000)))
        except BROKEN:
            broken += 1
            if broken > RECONNECTS:
                raise
            await asyncio.sleep(RECONNECT_DELAY_S * broken)
            continue
        broken = 0
        for _, batch in found or []:
            for text in reading.take(batch):
                yield text
        if reading.done is not None:
            return
    raise ResultTimeout(f"no end of the answer to {reading.request_id} on {key} in time")


def streamed_payload(payload: Any) -> Any:
    """The payload asking for a streamed answer."""
    if not isinstance(payload, dict):
        raise TypeError("a generative request's payload is an object ({'prompt': ...})")
    return {**payload, "stream": True}
