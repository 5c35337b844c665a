"""An input file into Redis, a window of lines at a time, whatever its size: the gateway's
POST /v1/files and `python -m producer batch create` share it.

Blank lines are skipped (a trailing newline, a CRLF file's); a line longer than
`max_line_bytes` is kept cut just past it, so validation refuses it by name and memory stays
bounded by a window of lines and one chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from producer.batches import keys
from producer.batches.store import READ_WINDOW, BatchStore


class FileTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than {limit} bytes (batch_max_file_bytes)")


async def save_chunks(store: BatchStore, file_id: str, chunks: AsyncIterator[bytes],
                      limit: int, max_line_bytes: int) -> tuple[int, int]:
    """(bytes, lines) of the file, its lines saved; FileTooLarge (nothing kept) past `limit`."""
    size, count, pending, window = 0, 0, b"", []
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            await store.drop_file(file_id, "")
            raise FileTooLarge(limit)
        *complete, pending = (pending + chunk).split(b"\n")
        pending = pending[:max_line_bytes + 1]
        window += [line.rstrip(b"\r")[:max_line_bytes + 1] for line in complete
                   if line.strip()]
        if len(window) >= READ_WINDOW:
            await store.save_lines(file_id, count, window)
            count, window = count + len(window), []
    if pending.strip():
        window.append(pending.rstrip(b"\r"))
    if window:
        await store.save_lines(file_id, count, window)
    return size, count + len(window)


async def upload(store: BatchStore, chunks: AsyncIterator[bytes], filename: str, owner: str,
                 limit: int, max_line_bytes: int) -> dict[str, Any]:
    """A new batch input file's object, published once all its lines are in."""
    file_id = keys.new_file_id()
    size, count = await save_chunks(store, file_id, chunks, limit, max_line_bytes)
    now_ms = int(time.time() * 1000)
    meta = {"id": file_id, "bytes": size, "created_at": now_ms // 1000, "created_ms": now_ms,
            "filename": filename[:256], "purpose": "batch", "owner": owner, "lines": count}
    await store.publish_file(meta)
    return meta
