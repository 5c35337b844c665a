"""What the pipeline needs of Redis, as small Protocols: a single Redis's parts
(streams/reader.py, replier.py, ...) and their Cluster twins (streams/shards.py, ...)
both provide them, so the pipeline imports neither the Cluster modules nor a union of both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.streams.reader import Entry
from worker.streams.replier import Reply
from worker.streams.token_streams import Chunk, FinalChunk, Progress


class Reader(Protocol):
    """Reads the model's stream for this consumer: its own pending entries first."""

    stream: str
    draining_own_pending: bool

    def ensure_group(self) -> None: ...
    def read(self, count: int, block_ms: int) -> list[Entry]: ...
    def close(self) -> list[Entry]: ...


class Replies(Protocol):
    """Answers and acks; `defers` says whether a failing part's replies may be held back
    (a Cluster shard mid-failover) for the reply thread to send again."""

    defers: bool

    def send(self, replies: Sequence[Reply]) -> list[str]: ...
    def send_available(self, replies: Sequence[Reply]) -> tuple[list[str], list[str]]: ...
    def next_retry_s(self) -> float: ...
    def ack(self, entry_ids: Sequence[str]) -> None: ...


class Reclaims(Protocol):
    """Claims the entries a dead consumer left pending."""

    def due(self) -> bool: ...
    def claim(self, count: int) -> list[Entry]: ...


class DeadLetters(Protocol):
    """Moves entries delivered too often aside; returns the others."""

    def divert(self, entries: Sequence[Entry]) -> list[Entry]: ...


class TokenStreams(Protocol):
    """A generative model's per-request reply streams."""

    def progress(self, keys: Sequence[str], max_tokens: Sequence[int]) -> list[Progress]: ...
    def keep_alive(self, entry_ids: Sequence[str]) -> list[str]: ...
    def write(self, chunks: Sequence[Chunk], cancel_keys: Sequence[str] = ()) -> list[bool]: ...
    def finish(self, finals: Sequence[FinalChunk]) -> list[str]: ...
