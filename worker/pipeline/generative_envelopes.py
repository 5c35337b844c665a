"""The envelopes of a generative model's answer (docs/protocol.md, "Generative models").

Streamed: chunks `{"id", "type": "delta", "index", "text", "token_ids"}` (and `logprobs`
when asked) on the request's
reply stream, then `{"id", "type": "done", "ok", "result" | "error", "meta"}` as the last
entry, written with the XACK by the reply thread. Not streamed (`"stream": false`): one
envelope on the list reply key, as for every other model.
"""

from __future__ import annotations

import time
from typing import Any

from producer import protocol
from producer.request_entry import Request
from worker.pipeline.answers import Answer
from worker.policy.flow import arrival_ms


def delta_envelope(request_id: str, index: int, text: str, token_ids: list[int],
                   logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A chunk; `logprobs` (asked for): one record per token of its text (EOS has none)."""
    envelope = {"id": request_id, "type": "delta", "index": index, "text": text,
                "token_ids": token_ids}
    return envelope if logprobs is None else {**envelope, "logprobs": logprobs}


def final_answer(entry_id: str, request: Request, envelope: dict[str, Any],
                 namespace: str, stream: bool, chunks_written: int) -> Answer:
    """The last answer of a generation: a `done` entry after the chunks on the reply
    stream, or the envelope alone on the list reply key."""
    arrived, background = arrival_ms(entry_id, time.time() * 1000), request.background
    if not stream:
        return Answer(entry_id, request.reply_to, request.content_type, envelope, arrived,
                      background=background)
    key = protocol.token_stream_key(namespace, request.id, request.reply_to)
    return Answer(entry_id, key, request.content_type, {**envelope, "type": "done"},
                  arrived, stream_index=chunks_written + 1, background=background)


def routed_error(answer: Answer, request: Request, namespace: str, stream: bool) -> Answer:
    """An error answer of a generative request (bad payload, deadline passed...): on its
    reply stream as its only entry unless it asked for `"stream": false`."""
    return final_answer(answer.entry_id, request, answer.envelope, namespace, stream, 0)


def generation_meta(model: str, worker: str, enqueued: int, started_ms: float | None,
                    first_token_ms: float | None, now_ms: float,
                    resumed_at: int = 0) -> dict[str, Any]:
    """The `meta` of a finished generation: its times from its arrival (flow.arrival_ms)."""
    started = started_ms or now_ms
    meta: dict[str, Any] = {
        "model": model, "queue_ms": round(started - enqueued, 3),
        "ttft_ms": None if first_token_ms is None else round(first_token_ms - enqueued, 3),
        "compute_ms": round(now_ms - started, 3), "worker": worker}
    if resumed_at:
        meta["resumed_at"] = resumed_at
    return meta
