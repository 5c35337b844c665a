"""The generate loop's chunk writes, on a thread of their own: a step's text goes out to Redis
while the next step runs.

Why: a step's chunks and its cancel check are one round trip to Redis; made between two steps,
the device waits for it (on a GPU a decode step of a small model takes a few milliseconds,
the round trip about one, and encoding a chunk per row a few µs each). Here each write is
queued to one thread, encoded there, and sent in order: a request's
chunks carry increasing ids, so one must never overtake another, and the answers queued
with a write (a request's `done` entry, an error placed after its chunks) go to the reply
thread only once the write is out. The loop waits for the previous step's write before it
queues the next, so at most one step's write is in flight, and reads its cancel flags then:
a cancellation takes effect one step later than the check that found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from producer import protocol
from worker.pipeline import ports
from worker.pipeline.answers import Answer, AnswerQueue
from worker.pipeline.retry import RedisRetry
from worker.streams.token_streams import Chunk


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A chunk to write: entry `<index>-1` of the reply stream `key`, its envelope encoded
    as the request's content type on the writer's thread."""

    key: str
    index: int
    envelope: dict[str, Any]
    content_type: str

    def chunk(self) -> Chunk:
        return Chunk(self.key, self.index, protocol.encode(self.envelope, self.content_type))


class ChunkWriter:
    def __init__(self, streams: ports.TokenStreams, retry: RedisRetry,
                 answers: AnswerQueue) -> None:
        self.streams, self.retry, self.answers = streams, retry, answers
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="redbatch-chunks")
        self._queued: list[Future[list[str]]] = []

    def write(self, chunks: Sequence[Outgoing], cancel_keys: dict[str, str] | None = None,
              answers: Sequence[Answer] = ()) -> None:
        """Queue the chunks, the cancel check of `cancel_keys` (entry id: its cancel key),
        then the answers, behind every write queued before."""
        self._queued.append(self._thread.submit(self._write, list(chunks),
                                                dict(cancel_keys or {}), list(answers)))

    def wait(self) -> set[str]:
        """Wait until every queued write is out (then raising the first failure); returns the
        entry ids their cancel checks found cancelled."""
        queued, self._queued = self._queued, []
        cancelled: set[str] = set()
        failed: BaseException | None = None
        for write in queued:  # all of them out before raising: none still writing after
            if (error := write.exception()) is not None:
                failed = failed or error
            else:
                cancelled.update(write.result())
        if failed is not None:
            raise failed
        return cancelled

    def close(self) -> None:
        """Wait for the queued writes, then stop the thread."""
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)

    def _write(self, chunks: list[Outgoing], cancel_keys: dict[str, str],
               answers: list[Answer]) -> list[str]:
        encoded = [chunk.chunk() for chunk in chunks]
        flags = self.retry(self.streams.write, encoded, list(cancel_keys.values())) \
            if encoded or cancel_keys else []
        if answers:
            self.answers.put(answers)
        return [entry_id for entry_id, flag in zip(cancel_keys, flags, strict=True) if flag]
