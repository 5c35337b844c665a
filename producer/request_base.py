"""What Client and AsyncClient share: request fields, chunks, back-pressure, replica checks,
and the rule that a request is only sent where its answer will land (generative models).

Its module constants (PIPELINE_CHUNK, MAX_BLOCK_S, ...) are read at call time by both
clients, so a caller (a test) sets one here for both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import redis

from producer import protocol
from producer.backlog import add_arguments, add_once_arguments
from producer.errors import Overloaded
from producer.models import ModelKind
from producer.replicas import ReplicaCount
from producer.request_entry import entry_fields
from producer.sharded import REMEMBERED_REPLY_KEYS, Sharding

DEFAULT_URL = "redis://localhost:6379/0"
PIPELINE_CHUNK = 1000
# Each BLPOP blocks at most this long, well inside the client's socket timeout (redis-py 8
# defaults to 5 s and raises TimeoutError on a longer block); longer waits take several.
MAX_BLOCK_S = 1.0
MIN_BLOCK_S = 0.01  # BLPOP with a timeout that rounds to 0 would block forever
# A write that a WAIT reports short of replicas, or whose connection broke, is sent again
# this many times (ADD_ONCE makes that idempotent), waiting RESUBMIT_DELAY_S x 2^attempt.
RESUBMITS = 6
RESUBMIT_DELAY_S = 0.1
RESUBMIT_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
                   redis.exceptions.MovedError, redis.exceptions.ClusterDownError,
                   redis.exceptions.TryAgainError)  # the last three: a cluster's failover
MARKER_TTL_MS = 3_600_000


def new_request_id() -> str:
    return uuid.uuid4().hex


def block_slices(timeout: float) -> Iterator[float]:
    """BLPOP timeouts that together wait `timeout` seconds; always at least one."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        yield min(max(remaining, MIN_BLOCK_S), MAX_BLOCK_S)
        if remaining <= MAX_BLOCK_S:
            return


class _Base(Sharding):
    """What both clients share: request fields, chunks, back-pressure, replica checks."""

    def __init__(self, model: str, namespace: str, content_type: str,
                 max_backlog: int | None, group: str,
                 replicas: ReplicaCount | None = None) -> None:
        super().__init__()
        if content_type not in protocol.CONTENT_TYPES:
            raise ValueError(f"content_type must be one of {protocol.CONTENT_TYPES}")
        if max_backlog is not None and max_backlog < 1:
            raise ValueError("max_backlog must be at least 1")
        self.model = model
        self.namespace = namespace
        self.content_type = content_type
        self.stream_key = protocol.stream_key(namespace, model)
        self.max_backlog = max_backlog
        self.group = group
        # WAIT after each write for this many replicas (producer/replicas.py)
        self.replicas = replicas or ReplicaCount(0)
        self.short_waits = 0  # writes a WAIT reported short of replicas (each resubmitted)
        self.foreign_envelopes = 0  # replies on our keys that answer no request of ours
        self.kind = ModelKind()  # whether the model is generative, from its announcements
        # submitted ids whose answer is a token stream (the newest REMEMBERED_REPLY_KEYS: a
        # caller that reads the stream itself, as the gateway does, never calls wait())
        self._streamed: dict[str, None] = {}

    def _own(self, data: bytes, request_ids: Collection[str]) -> dict[str, Any] | None:
        """The envelope when it answers one of `request_ids`; else None, counted: any
        producer can name our reply key as its reply_to, so an envelope's id is checked."""
        envelope = protocol.envelope_for(data, request_ids)
        self.foreign_envelopes += envelope is None
        return envelope

    def _once_call(self, ids: Sequence[str], entries: list[Any],
                   shard: int | None = None) -> tuple[list[str], list[Any]]:
        """(KEYS, ARGV) of ADD_ONCE: the stream and one request marker per entry."""
        return [self._stream_of(shard), *self._markers(ids, shard)], add_once_arguments(
            self.group, self._limit(), MARKER_TTL_MS, entries)

    def _chunks(self, payloads: Sequence[Any], reply_to: str | None, deadline_ms: int | None,
                priority: int, request_ids: Sequence[str] | None = None
                ) -> Iterator[tuple[list[str], list[Any]]]:
        """(ids, fields) per chunk of at most PIPELINE_CHUNK requests; `request_ids`: the
        ids to use (else new ones)."""
        size = PIPELINE_CHUNK
        for start in range(0, len(payloads), size):
            chunk = payloads[start:start + size]
            ids = list(request_ids[start:start + size]) if request_ids is not None else [
                new_request_id() for _ in chunk]
            yield ids, [self._fields(payload, request_id, reply_to, deadline_ms, priority)
                        for payload, request_id in zip(chunk, ids, strict=True)]

    def _replicated(self, result: list[Any], acked: int, wanted: int,
                    submitted: Sequence[str],
                    replicas: ReplicaCount | None = None) -> bool:
        """Whether an ADD_ONCE + WAIT is done: Overloaded if refused; a short WAIT is
        counted and means send again."""
        self._accepted(result, submitted)
        if acked >= wanted:
            return True
        self.short_waits += 1
        (replicas or self.replicas).short()
        return False

    def _add_arguments(self, entries: list[Any]) -> list[Any]:
        limit = self._limit()
        assert limit is not None
        return add_arguments(self.group, limit, entries)

    def _limited_chunks(self, payloads: Sequence[Any], reply_to: str | None,
                        deadline_ms: int | None, priority: int,
                        request_ids: Sequence[str] | None = None
                        ) -> Iterator[tuple[list[str], Any]]:
        """(ids, ADD_IF_UNDER arguments) per chunk: each chunk is added whole or refused."""
        for ids, entries in self._chunks(payloads, reply_to, deadline_ms, priority,
                                         request_ids):
            yield ids, self._add_arguments(entries)

    def _accepted(self, result: list[Any], submitted: Sequence[str] = ()) -> None:
        """Raise Overloaded if ADD_IF_UNDER refused the entries."""
        if not result[0]:
            assert self.max_backlog is not None
            raise Overloaded(int(result[1]), self.max_backlog, submitted)

    def _fields(self, payload: Any, request_id: str, reply_to: str | None,
                deadline_ms: int | None, priority: int) -> Any:
        payload = self._answerable(payload, request_id, reply_to)
        return entry_fields(
            request_id, protocol.encode(payload, self.content_type),
            content_type=self.content_type, reply_to=reply_to, deadline_ms=deadline_ms,
            priority=priority)

    def new_reply_key(self) -> str:
        """A fresh shared reply key, for collecting many replies on one list."""
        return protocol.reply_key(self.namespace, f"batch-{new_request_id()}")


    def _answerable(self, payload: Any, request_id: str, reply_to: str | None) -> Any:
        """The payload as sent to a generative model, so that its answer lands where wait()
        looks: a list `reply_to` gets `"stream": false` unless the payload says otherwise;
        a streamed answer (the protocol's default) is remembered, and wait() reads that
        request's token stream to its end."""
        if not (self.kind.generative and isinstance(payload, dict)) or \
                payload.get("stream") is False:
            return payload
        streamed_to = protocol.token_stream_key(self.namespace, request_id, reply_to)
        if not streamed_to.startswith(f"{self.namespace}:stream:"):  # a list reply key
            return payload if payload.get("stream") else {**payload, "stream": False}
        self._streamed[request_id] = None
        while len(self._streamed) > REMEMBERED_REPLY_KEYS:
            del self._streamed[next(iter(self._streamed))]
        return payload

    def token_stream(self, request_id: str, reply_to: str | None = None) -> str:
        """Where a streamed request's answer goes (protocol.token_stream_key)."""
        return protocol.token_stream_key(self.namespace, request_id,
                                         reply_to or self.reply_key(request_id))
