"""A streamed `tool_choice` "auto" answer read from a real Redis reply stream by the gateway's
StreamReply: text goes out as deltas, a call (which the tiny test model never happens to
make) whole in one chunk at the end, a cut call as its raw text, and nothing that may still
become the call marker leaks as content."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis
import redis.asyncio as aioredis

from producer import protocol
from producer.gateway.generation import Generations, StreamReply
from producer.gateway.generation_shapes import parse_chat_request
from producer.gateway.tool_auto import CLOSE
from tests.unit.producer.test_gateway_tool_auto import CALL, CHAT


def streamed(redis_url: str, texts: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    """The chunks StreamReply sends for an "auto" answer of these deltas, written to the
    request's reply stream as a worker writes them."""
    request_id = f"auto-{abs(hash((tuple(texts), reason)))}"
    envelopes = [{"id": request_id, "type": "delta", "text": t} for t in texts]
    envelopes.append({"id": request_id, "type": "done", "ok": True, "result": {
        "text": "".join(texts), "finish_reason": reason, "tokens": len(texts)}})
    sync = redis.Redis.from_url(redis_url)
    for envelope in envelopes:
        sync.xadd(protocol.token_stream_key("redbatch", request_id),
                  {"data": json.dumps(envelope)})

    async def events() -> list[bytes]:
        client = aioredis.Redis.from_url(redis_url)
        generations = Generations(client, None, "redbatch", 5.0)  # type: ignore[arg-type]
        reply = StreamReply(generations, parse_chat_request({**CHAT, "stream": True}),
                            request_id)
        found = [e async for e in reply.events(await reply.first())]
        await client.aclose()
        return found

    return [json.loads(e[6:]) for e in asyncio.run(events()) if e != b"data: [DONE]\n\n"]


def contents(chunks: list[dict[str, Any]]) -> list[str | None]:
    return [c["choices"][0]["delta"].get("content") for c in chunks]


def test_a_streamed_auto_answer_sends_text_as_deltas_and_a_call_whole(redis_url: str) -> None:
    text = streamed(redis_url, ["\n<to", "day is", " fine"])
    assert contents(text) == ["", "\n<to", "day is", " fine", None]
    assert text[-1]["choices"][0]["finish_reason"] == "stop"
    call = streamed(redis_url, ["\n<tool", "_call>", CALL, CLOSE])
    assert contents(call) == ["", None, None]
    entry = call[1]["choices"][0]["delta"]["tool_calls"][0]
    assert entry["index"] == 0 and entry["function"]["name"] == "add"
    assert json.loads(entry["function"]["arguments"]) == {"a": 2, "b": 3}
    assert call[-1]["choices"][0]["finish_reason"] == "tool_calls"
    cut = streamed(redis_url, ["<tool_call>", CALL[:10]], "length")
    assert contents(cut) == ["", f"<tool_call>{CALL[:10]}", None]
    assert cut[-1]["choices"][0]["finish_reason"] == "length"
    held = streamed(redis_url, ["<tool"], "length")  # ended while it might become the marker
    assert contents(held) == ["", "<tool", None]
