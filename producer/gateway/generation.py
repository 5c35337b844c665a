"""POST /v1/chat/completions and /v1/completions: generative models through Redis.

A request is submitted with `producer.AsyncClient` (deadline_ms = now + request_timeout_s).
`stream: false` sends `"stream": false` in the payload and BLPOPs the request's list reply
key while it watches the ASGI channel for the client's `http.disconnect`. `stream: true`
reads the reply stream `redbatch:stream:<id>` with XREAD BLOCK from `0-0`, keeping the last
id, and serves each delta as a server-sent event; the first entry is read before the
response starts, so a refused request is a plain HTTP error. A client that goes away, mid-
stream (the SSE generator is cancelled or closed) or while a `stream: false` answer is
awaited, cancels the generation: `SET redbatch:cancel:<id> 1 PX <ms>`. The worker's
finish_reason reaches the client as one of OpenAI's values (generation_shapes.py, which
holds the response shapes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from producer import protocol
from producer.errors import Overloaded
from producer.gateway import errors, jsonio
from producer.gateway.dispatch import Dispatcher
from producer.gateway.errors import ApiError
from producer.gateway.generation_shapes import (
    CHAT,
    GenerationRequest,
    chunk,
    completion_response,
    openai_finish_reason,
    tool_call_chunk,
    usage_chunk,
)
from producer.gateway.logprob_shapes import shaped, text_length
from producer.gateway.metrics import FOREIGN_ENVELOPES
from producer.gateway.tool_auto import MarkerHold
from producer.liveness import Kind
from producer.request_base import block_slices

Entry = tuple[str, dict[str, Any]]
Receive = Callable[[], Awaitable[Any]]  # the ASGI receive channel
T = TypeVar("T")
CANCEL_MARGIN_MS = 60_000  # the cancel key outlives the request's deadline by this much
API_NAMES = {"max_new_tokens": "max_tokens"}  # payload keys the API names otherwise
CLIENT_CLOSED = 499  # the status recorded (nginx's) for an answer nobody was left to read


def decode_entry(data: bytes) -> dict[str, Any]:
    """A reply-stream envelope (delta or done), JSON or msgpack as the request was."""
    envelope = protocol.decode(data, protocol.JSON if data[:1] == b"{" else protocol.MSGPACK)
    if not isinstance(envelope, dict) or "type" not in envelope:
        raise ValueError("reply stream entry is not a redbatch envelope")
    return envelope


def own_entry(data: bytes, request_id: str) -> dict[str, Any] | None:
    """A reply-stream envelope of this request, or None (another's, or no envelope)."""
    try:
        envelope = decode_entry(data)
    except ValueError:
        return None
    return envelope if envelope.get("id") == request_id else None


def worker_error(envelope: dict[str, Any], param: str) -> ApiError:
    """A failure envelope as an ApiError. The param is the payload key the worker names
    (`field`) in the API's name, else the request's input field `param`."""
    error = envelope.get("error") or {}
    api_error = errors.from_worker(error)
    if api_error.param != "input":
        return api_error
    field = error.get("field")
    api_error.param = param if field in (None, "prompt", "messages", "payload") \
        else API_NAMES.get(field, str(field))
    if error.get("reason") == "context_window":
        api_error.code = "context_length_exceeded"  # OpenAI's code for a long prompt
    return api_error


def sse(data: Any) -> bytes:
    text = data.encode() if isinstance(data, str) else jsonio.dumps(data)
    return b"data: " + text + b"\n\n"


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client has gone: the request body is read by then, so the next ASGI
    message is `http.disconnect` (uvicorn sends it once the connection is lost)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """(True, its result) when `work` ends first, (False, None) when the client goes first
    (`work` is cancelled then); a result that came with the disconnect still counts."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()
    if done.done() and not done.cancelled():
        return True, done.result()
    return False, None


class Generations:
    """The Redis side of a generation: submit, wait, read the stream, cancel."""

    def __init__(self, redis: aioredis.Redis, dispatcher: Dispatcher, namespace: str,
                 timeout_s: float) -> None:
        self.redis, self.dispatcher = redis, dispatcher
        self.namespace, self.timeout_s = namespace, timeout_s

    async def submit(self, model: str, payload: dict[str, Any]) -> str:
        deadline_ms = int(time.time() * 1000 + self.timeout_s * 1000)
        try:
            return await self.dispatcher.client(model).submit(payload, deadline_ms=deadline_ms)
        except Overloaded as exc:
            raise errors.overloaded(exc.backlog, exc.max_backlog) from None

    async def cancel(self, request_id: str) -> None:
        await self.redis.set(protocol.cancel_key(self.namespace, request_id), 1,
                             px=int(self.timeout_s * 1000) + CANCEL_MARGIN_MS)

    async def wait_reply(self, request_id: str) -> dict[str, Any]:
        """The list reply of a `"stream": false` request; cancel and 504 past the timeout."""
        key = protocol.reply_key(self.namespace, request_id)
        for block_s in block_slices(self.timeout_s):
            popped: Any = await self.redis.blpop([key], timeout=block_s)
            envelope = popped and protocol.envelope_for(popped[1], (request_id,))
            if envelope:
                return envelope
            FOREIGN_ENVELOPES.inc(popped is not None)
        await self.cancel(request_id)
        await self.redis.delete(key)
        raise errors.timed_out(self.timeout_s)

    async def wait_or_cancel(self, request_id: str,
                             receive: Receive) -> dict[str, Any] | None:
        """wait_reply, unless the client disconnects first: then the generation is cancelled
        and None returned (the worker's `cancelled` reply expires unread, by its TTL)."""
        answered, reply = await unless_disconnected(self.wait_reply(request_id), receive)
        if not answered:
            await self.cancel(request_id)
        return reply

    async def read(self, key: str, last: str, deadline: float,
                   request_id: str) -> list[Entry]:
        """The entries of `request_id` after `last`, waiting until there are some; [] past
        `deadline`. Entries of another id (or none) are skipped and counted."""
        while (remaining := deadline - time.monotonic()) > 0:
            block_ms = max(10, int(min(remaining, 1.0) * 1000))
            found: Any = await self.redis.xread({key: last}, count=256, block=block_ms)
            read = [(_text(entry_id), fields.get(b"data", b""))
                    for _, batch in found or [] for entry_id, fields in batch]
            entries = [(entry_id, envelope) for entry_id, envelope in
                       ((i, own_entry(data, request_id)) for i, data in read) if envelope]
            FOREIGN_ENVELOPES.inc(len(read) - len(entries))
            if entries:
                return entries
            last = read[-1][0] if read else last
        return []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StreamReply:
    """One streamed generation: the reply stream's entries as OpenAI chunks (SSE)."""

    def __init__(self, generations: Generations, request: GenerationRequest,
                 request_id: str) -> None:
        self.generations, self.request, self.request_id = generations, request, request_id
        self.key = protocol.token_stream_key(generations.namespace, request_id)
        self.created = int(time.time())
        self.deadline = time.monotonic() + generations.timeout_s
        self.param = "messages" if request.kind == CHAT else "prompt"
        self.offset = 0  # completions' text_offset of the next chunk's first token
        self.hold = MarkerHold() if request.tool_auto else None  # "auto": a call's deltas

    async def first(self) -> list[Entry]:
        """The first entries, before the response starts: errors are HTTP errors then."""
        entries = await self.generations.read(self.key, "0-0", self.deadline, self.request_id)
        if not entries:
            await self.generations.cancel(self.request_id)
            raise errors.timed_out(self.generations.timeout_s)
        envelope = entries[0][1]
        if envelope["type"] == "done" and not envelope.get("ok"):
            await self.generations.redis.delete(self.key)
            raise worker_error(envelope, self.param)
        return entries

    async def events(self, entries: list[Entry]) -> AsyncIterator[bytes]:
        """SSE events until the done entry; cancels the generation unless it ended."""
        finished, sent = False, 0
        try:
            if self.request.kind == CHAT:
                yield sse(self._chunk("", first=True))
            while entries:
                for _, envelope in entries:
                    if envelope["type"] != "done":
                        sent += 1
                        for delta in self._release(envelope):  # a call comes whole, at the end
                            yield sse(self._delta(delta))
                        continue
                    finished = True  # deleted before the client can see the end
                    await self.generations.redis.delete(self.key)
                    for event in self._done(envelope):
                        yield event
                    return
                entries = await self.generations.read(self.key, entries[-1][0], self.deadline,
                                                      self.request_id)
            yield sse(errors.stream_timed_out(self.generations.timeout_s, sent).body())
        finally:
            if not finished:  # the client went away, or the deadline passed
                with anyio.CancelScope(shield=True):
                    await self.generations.cancel(self.request_id)

    def _chunk(self, text: str | None, reason: str | None = None,
               first: bool = False) -> dict[str, Any]:
        return chunk(self.request, self.request_id, self.created, text, reason, first)

    def _release(self, envelope: dict[str, Any]) -> list[dict[str, Any]]:
        """The deltas to send now: none of a forced call, an "auto" answer's once it is text."""
        if self.hold is not None:
            return self.hold.take(envelope)
        return [] if self.request.tool_call else [envelope]

    def _delta(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """A delta's chunk, with its tokens' logprobs where the worker sent them."""
        records = envelope.get("logprobs")
        logprobs = shaped(self.request.kind == CHAT, records, self.offset)
        self.offset += text_length(records)
        return chunk(self.request, self.request_id, self.created,
                     str(envelope.get("text", "")), logprobs=logprobs)

    def _done(self, envelope: dict[str, Any]) -> list[bytes]:
        if not envelope.get("ok"):
            return [sse(worker_error(envelope, self.param).body())]
        result = envelope.get("result") or {}
        reason = openai_finish_reason(result.get("finish_reason"))
        events = [sse(self._delta(delta)) for delta in self.hold.flush()] if self.hold else []
        if self.request.tool_call and (self.hold is None or self.hold.is_call()):
            # the call, or (cut by max_tokens) the text as it is
            text = str(result.get("text", ""))
            call = tool_call_chunk(self.request, self.request_id, self.created, text) \
                if reason == "stop" else None
            events.append(sse(call[0] if call else self._chunk(text)))
            reason = call[1] if call else reason
        events.append(sse(self._chunk(None, reason)))
        if self.request.include_usage:
            events.append(sse(usage_chunk(self.request, self.request_id, self.created,
                                          result)))
        return [*events, sse("[DONE]")]


async def prepare(request: Request, parse: Callable[[Any], GenerationRequest]
                  ) -> GenerationRequest:
    """Authorize, validate, check the model is live."""
    gateway = request.app.state.gateway
    gateway.authorize(request)
    parsed = parse(await gateway.json_body(request))
    await gateway.require_live(parsed.model, Kind.GENERATIVE)
    return parsed


async def generate(request: Request, parsed: GenerationRequest) -> Response:
    """One choice: submit, then stream or wait (choices.py runs n of them)."""
    generations: Generations = request.app.state.gateway.generations
    request_id = await generations.submit(parsed.model, parsed.payload)
    if parsed.stream:
        reply = StreamReply(generations, parsed, request_id)
        entries = await reply.first()
        return StreamingResponse(reply.events(entries), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    envelope = await generations.wait_or_cancel(request_id, request.receive)
    if envelope is None:
        return Response(status_code=CLIENT_CLOSED)
    if not envelope.get("ok"):
        raise worker_error(envelope, "messages" if parsed.kind == CHAT else "prompt")
    return jsonio.FastJSONResponse(completion_response(parsed, request_id, int(time.time()),
                                            envelope.get("result") or {}))
