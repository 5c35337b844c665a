"""POST /v1/chat/completions and /v1/completions with n > 1 or a list of prompts: each
choice a generation of its own on the workers (choice_fields.py makes their payloads,
seed + j for sample j), answered as one OpenAI response.

Not streamed: every choice's list reply is awaited (a client that goes away cancels them
all). Streamed: the choices' reply streams are read together (one XREAD over all of them)
and each delta becomes a chunk carrying its choice's `index`; a choice's `done` entry its
finish chunk; once all are done, the usage chunk (stream_options) and `[DONE]`. A failure
of one choice (before the response starts: its HTTP error) cancels the others.

Sample j > 0 of a prompt names sample 0 in its payload (`fork_of`): a worker that holds both
prefills the prompt once and lets the others share its KV blocks (worker/execution/forks.py);
each choice is still a request of its own (its reply stream, its resume after a crash).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from producer import protocol
from producer.errors import Overloaded
from producer.gateway import errors, jsonio
from producer.gateway.choice_fields import check_choices, choice_payloads
from producer.gateway.errors import invalid
from producer.gateway.generation import (
    CLIENT_CLOSED,
    Generations,
    generate,
    own_entry,
    prepare,
    sse,
    unless_disconnected,
    worker_error,
)
from producer.gateway.generation_shapes import (
    CHAT,
    GenerationRequest,
    chunk,
    completion_response,
    openai_finish_reason,
    parse_chat_request,
    parse_completion_request,
    usage_chunk,
)
from producer.gateway.logprob_shapes import shaped, text_length
from producer.gateway.metrics import FOREIGN_ENVELOPES
from producer.request_base import new_request_id


async def chat_completions(request: Request) -> Response:
    return await route(request, await prepare(request, parse_chat_request))


async def completions(request: Request) -> Response:
    return await route(request, await prepare(request, parse_completion_request))


async def route(request: Request, parsed: GenerationRequest) -> Response:
    if parsed.choices == 1:
        return await generate(request, parsed)
    gateway = request.app.state.gateway
    check_choices(max(1, len(parsed.prompts)), parsed.n, gateway.settings.max_choices)
    if parsed.stream and parsed.tool_call:  # a streamed call comes whole: one choice only
        raise invalid("a streamed tool call takes n = 1", "n", "unsupported_parameter")
    generations: Generations = gateway.generations
    ids = await submit_all(generations, parsed)
    if parsed.stream:
        reply = ChoiceStreams(generations, parsed, ids)
        entries = await reply.first()
        return StreamingResponse(reply.events(entries), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    results = await wait_all(generations, ids, request, parsed)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return jsonio.FastJSONResponse(combined(parsed, ids[0], results))


async def submit_all(generations: Generations, parsed: GenerationRequest) -> list[str]:
    """Every choice's request, in choice order, in one call."""
    payloads = choice_payloads(parsed.payload, list(parsed.prompts) or None, parsed.n)
    ids = [new_request_id() for _ in payloads]
    for k, payload in enumerate(payloads):  # sample 0 of its prompt: the others' source
        if k % parsed.n:
            payload["fork_of"] = ids[k - k % parsed.n]
    deadline_ms = int(time.time() * 1000 + generations.timeout_s * 1000)
    client = generations.dispatcher.client(parsed.model)
    try:
        return await client.submit_many(payloads, deadline_ms=deadline_ms, request_ids=ids)
    except Overloaded as exc:
        raise errors.overloaded(exc.backlog, exc.max_backlog) from None


async def cancel_all(generations: Generations, ids: list[str]) -> None:
    with anyio.CancelScope(shield=True):
        for request_id in ids:
            await generations.cancel(request_id)


async def wait_all(generations: Generations, ids: list[str], request: Request,
                   parsed: GenerationRequest) -> list[dict[str, Any]] | None:
    """Every choice's result, in order; None when the client went away first (all are
    cancelled); a failed choice's error (the others cancelled)."""
    answered, envelopes = await unless_disconnected(
        asyncio.gather(*map(generations.wait_reply, ids)), request.receive)
    if not answered or envelopes is None:
        await cancel_all(generations, ids)
        return None
    for envelope in envelopes:
        if not envelope.get("ok"):
            await cancel_all(generations, ids)
            raise worker_error(envelope, "messages" if parsed.kind == CHAT else "prompt")
    return [envelope.get("result") or {} for envelope in envelopes]


def combined(parsed: GenerationRequest, request_id: str,
             results: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of every choice, indexed in order; usage summed (each prompt's
    tokens counted once, as OpenAI)."""
    created = int(time.time())
    answers = [completion_response(parsed, request_id, created, r) for r in results]
    body = answers[0]
    body["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in results[::parsed.n])
    completion = sum(int(r.get("tokens") or 0) for r in results)
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
    return body


class ChoiceStreams:
    """The choices' reply streams, read together, as one stream of OpenAI chunks."""

    def __init__(self, generations: Generations, request: GenerationRequest,
                 ids: list[str]) -> None:
        self.generations, self.request, self.ids = generations, request, ids
        namespace = generations.namespace
        self.keys = [protocol.token_stream_key(namespace, i) for i in ids]
        self.last = dict.fromkeys(self.keys, "0-0")  # the unfinished ones' last ids
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.created = int(time.time())
        self.deadline = time.monotonic() + generations.timeout_s
        self.offsets = [0] * len(ids)  # completions' text_offset per choice
        self.results: list[dict[str, Any]] = [{} for _ in ids]
        self.param = "messages" if request.kind == CHAT else "prompt"

    async def read(self) -> list[tuple[int, dict[str, Any]]]:
        """The next entries of any unfinished choice, as (choice, envelope); [] past the
        deadline."""
        redis = self.generations.redis
        while (remaining := self.deadline - time.monotonic()) > 0 and self.last:
            block_ms = max(10, int(min(remaining, 1.0) * 1000))
            streams: Any = dict(self.last)
            found: Any = await redis.xread(streams, count=256, block=block_ms)
            out = []
            for key, batch in found or []:
                key = key.decode() if isinstance(key, bytes) else str(key)
                choice = self.index[key]
                for entry_id, fields in batch:
                    self.last[key] = entry_id.decode() if isinstance(entry_id, bytes) \
                        else str(entry_id)
                    envelope = own_entry(fields.get(b"data", b""), self.ids[choice])
                    FOREIGN_ENVELOPES.inc(envelope is None)
                    if envelope is not None:
                        out.append((choice, envelope))
            if out:
                return out
        return []

    async def first(self) -> list[tuple[int, dict[str, Any]]]:
        """The first entries, before the response starts: a refusal is an HTTP error."""
        entries = await self.read()
        if not entries:
            await cancel_all(self.generations, self.ids)
            raise errors.timed_out(self.generations.timeout_s)
        for _, envelope in entries:
            if envelope["type"] == "done" and not envelope.get("ok"):
                await cancel_all(self.generations, self.ids)
                await self.generations.redis.delete(*self.keys)
                raise worker_error(envelope, self.param)
        return entries

    async def events(self, entries: list[tuple[int, dict[str, Any]]]) -> AsyncIterator[bytes]:
        """SSE events until every choice is done; cancels the unfinished ones unless all
        ended."""
        finished = False
        try:
            if self.request.kind == CHAT:
                for choice in range(len(self.ids)):
                    yield sse(self._chunk(choice, "", first=True))
            while entries:
                for choice, envelope in entries:
                    for event in self._event(choice, envelope):
                        yield event
                if not self.last:
                    finished = True  # the streams are read: deleted, as a single reply's
                    await self.generations.redis.delete(*self.keys)
                    for event in self._end():
                        yield event
                    return
                entries = await self.read()
            yield sse(errors.stream_timed_out(self.generations.timeout_s, 0).body())
        finally:
            if not finished:
                await cancel_all(self.generations, self.ids)

    def _event(self, choice: int, envelope: dict[str, Any]) -> list[bytes]:
        if envelope["type"] != "done":
            records = envelope.get("logprobs")
            logprobs = shaped(self.request.kind == CHAT, records, self.offsets[choice])
            self.offsets[choice] += text_length(records)
            return [sse(self._chunk(choice, str(envelope.get("text", "")),
                                    logprobs=logprobs))]
        self.last.pop(self.keys[choice], None)
        if not envelope.get("ok"):
            self.last.clear()  # the whole answer ends with the error
            return [sse(worker_error(envelope, self.param).body())]
        self.results[choice] = envelope.get("result") or {}
        reason = openai_finish_reason(self.results[choice].get("finish_reason"))
        return [sse(self._chunk(choice, None, reason))]

    def _end(self) -> list[bytes]:
        events = []
        if self.request.include_usage and all(self.results):
            usage = combined(self.request, self.ids[0], self.results)["usage"]
            body = usage_chunk(self.request, self.ids[0], self.created, {})
            events.append(sse({**body, "usage": usage}))
        return [*events, sse("[DONE]")]

    def _chunk(self, choice: int, text: str | None, reason: str | None = None,
               first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        body = chunk(self.request, self.ids[0], self.created, text, reason, first, logprobs)
        body["choices"][0]["index"] = choice
        return body
