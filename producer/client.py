"""The Python client: enqueue requests on a model's stream and wait for their replies.

`Client` is synchronous and `AsyncClient` its asyncio twin; both speak protocol v1 with
plain Redis commands (XADD to submit, BLPOP on the reply key to wait).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis

from producer import protocol

DEFAULT_URL = "redis://localhost:6379/0"
PIPELINE_CHUNK = 1000
# Each BLPOP blocks at most this long, well inside the client's socket timeout (redis-py 8
# defaults to 5 s and raises TimeoutError on a longer block); longer waits take several.
MAX_BLOCK_S = 1.0
MIN_BLOCK_S = 0.01  # BLPOP with a timeout that rounds to 0 would block forever


class RedbatchError(Exception):
    """Base of the client's errors."""


class RequestFailed(RedbatchError):
    """The worker answered with an error envelope."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class ResultTimeout(RedbatchError):
    """No reply arrived in time; the request may still be answered later."""


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


def unwrap(envelope: dict[str, Any]) -> Any:
    """The result of a success envelope, or RequestFailed for an error envelope."""
    if envelope["ok"]:
        return envelope["result"]
    error = envelope.get("error") or {}
    raise RequestFailed(str(envelope.get("id")), error.get("code", "unknown"),
                        error.get("message", ""))


class _Base:
    def __init__(self, model: str, namespace: str, content_type: str) -> None:
        if content_type not in protocol.CONTENT_TYPES:
            raise ValueError(f"content_type must be one of {protocol.CONTENT_TYPES}")
        self.model = model
        self.namespace = namespace
        self.content_type = content_type
        self.stream = protocol.stream_key(namespace, model)

    def _fields(self, payload: Any, request_id: str, reply_to: str | None,
                deadline_ms: int | None, priority: int) -> Any:
        return protocol.entry_fields(
            request_id, protocol.encode(payload, self.content_type),
            content_type=self.content_type, reply_to=reply_to, deadline_ms=deadline_ms,
            priority=priority)

    def reply_key(self, request_id: str) -> str:
        return protocol.reply_key(self.namespace, request_id)

    def new_reply_key(self) -> str:
        """A fresh shared reply key, for collecting many replies on one list."""
        return protocol.reply_key(self.namespace, f"batch-{new_request_id()}")


class Client(_Base):
    """Synchronous client.

    >>> client = Client("redis://localhost:6379/0", model="minilm")
    >>> client.infer({"text": "hello"})["embedding"][:3]
    """

    def __init__(self, url: str = DEFAULT_URL, model: str = "minilm", *,
                 namespace: str = protocol.DEFAULT_NAMESPACE,
                 content_type: str = protocol.MSGPACK,
                 redis_client: redis.Redis | None = None) -> None:
        super().__init__(model, namespace, content_type)
        self.redis = redis_client or redis.Redis.from_url(url)

    def submit(self, payload: Any, *, request_id: str | None = None, reply_to: str | None = None,
               deadline_ms: int | None = None, priority: int = 0) -> str:
        """Enqueue one request; returns its id."""
        request_id = request_id or new_request_id()
        self.redis.xadd(self.stream, self._fields(payload, request_id, reply_to, deadline_ms,
                                                  priority))
        return request_id

    def submit_many(self, payloads: Iterable[Any], *, reply_to: str | None = None,
                    deadline_ms: int | None = None, priority: int = 0) -> list[str]:
        """Enqueue many requests in pipelined round trips; returns their ids in order."""
        ids: list[str] = []
        pipe = self.redis.pipeline(transaction=False)
        for payload in payloads:
            ids.append(new_request_id())
            pipe.xadd(self.stream, self._fields(payload, ids[-1], reply_to, deadline_ms,
                                                priority))
            if len(pipe) >= PIPELINE_CHUNK:
                pipe.execute()
        pipe.execute()
        return ids

    def wait(self, request_id: str, timeout: float = 30.0,
             reply_to: str | None = None) -> dict[str, Any]:
        """The reply envelope of one request (ok or not); ResultTimeout if none came."""
        key = reply_to or self.reply_key(request_id)
        for block_s in block_slices(timeout):
            popped: Any = self.redis.blpop([key], timeout=block_s)
            if popped is not None:
                return protocol.decode_envelope(popped[1])
        raise ResultTimeout(f"no reply for request {request_id} within {timeout} s")

    def result(self, request_id: str, timeout: float = 30.0) -> Any:
        """The result of one request; RequestFailed or ResultTimeout otherwise."""
        return unwrap(self.wait(request_id, timeout))

    def infer(self, payload: Any, timeout: float = 30.0, **options: Any) -> Any:
        """Submit and wait in one call."""
        return self.result(self.submit(payload, **options), timeout)

    def collect(self, reply_to: str, count: int, timeout: float = 60.0,
                on_reply: Any = None) -> list[dict[str, Any]]:
        """Pop up to `count` envelopes from a shared reply key, until `timeout` elapses."""
        envelopes: list[dict[str, Any]] = []
        for block_s in block_slices(timeout):
            if len(envelopes) >= count:
                break
            popped: Any = self.redis.blpop([reply_to], timeout=block_s)
            if popped is None:
                continue
            more = count - len(envelopes) - 1
            batch = [popped[1], *((self.redis.lpop(reply_to, more) or []) if more else [])]
            for data in batch:
                envelopes.append(protocol.decode_envelope(data))
                if on_reply:
                    on_reply(envelopes[-1])
        return envelopes

    def close(self) -> None:
        self.redis.close()


class AsyncClient(_Base):
    """asyncio client with the same calls as Client."""

    def __init__(self, url: str = DEFAULT_URL, model: str = "minilm", *,
                 namespace: str = protocol.DEFAULT_NAMESPACE,
                 content_type: str = protocol.MSGPACK,
                 redis_client: aioredis.Redis | None = None) -> None:
        super().__init__(model, namespace, content_type)
        self.redis = redis_client or aioredis.Redis.from_url(url)

    async def submit(self, payload: Any, *, request_id: str | None = None,
                     reply_to: str | None = None, deadline_ms: int | None = None,
                     priority: int = 0) -> str:
        request_id = request_id or new_request_id()
        await self.redis.xadd(self.stream, self._fields(payload, request_id, reply_to,
                                                        deadline_ms, priority))
        return request_id

    async def submit_many(self, payloads: Sequence[Any], *, reply_to: str | None = None,
                          deadline_ms: int | None = None, priority: int = 0) -> list[str]:
        ids: list[str] = []
        for start in range(0, len(payloads), PIPELINE_CHUNK):
            async with self.redis.pipeline(transaction=False) as pipe:
                for payload in payloads[start:start + PIPELINE_CHUNK]:
                    ids.append(new_request_id())
                    pipe.xadd(self.stream, self._fields(payload, ids[-1], reply_to,
                                                        deadline_ms, priority))
                await pipe.execute()
        return ids

    async def wait(self, request_id: str, timeout: float = 30.0,
                   reply_to: str | None = None) -> dict[str, Any]:
        key = reply_to or self.reply_key(request_id)
        for block_s in block_slices(timeout):
            popped: Any = await self.redis.blpop([key], timeout=block_s)
            if popped is not None:
                return protocol.decode_envelope(popped[1])
        raise ResultTimeout(f"no reply for request {request_id} within {timeout} s")

    async def result(self, request_id: str, timeout: float = 30.0) -> Any:
        return unwrap(await self.wait(request_id, timeout))

    async def infer(self, payload: Any, timeout: float = 30.0, **options: Any) -> Any:
        return await self.result(await self.submit(payload, **options), timeout)

    async def close(self) -> None:
        await self.redis.aclose()
