"""The generate loop's live requests, from their admission to their answer: each one's reply
stream, the chunks written to it, its times, and the entries and answers that carry its text
to the producer (docs/protocol.md, "Generative models").

No engine, no scheduler, no Redis: the generate loop (pipeline/generate.py) moves sequences
in and out of those and hands what is made here to the chunk writer and the reply thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from producer import protocol
from producer.protocol import ErrorCode
from worker.execution.detokenize import Delta, TextState
from worker.execution.logprobs import public as _public
from worker.models.generation_params import GenerationInput
from worker.observe import metrics
from worker.pipeline.answers import Answer, error_answer
from worker.pipeline.chunk_writer import Outgoing
from worker.pipeline.generative_envelopes import (
    delta_envelope,
    final_answer,
    generation_meta,
    routed_error,
)
from worker.policy.batching import Pending
from worker.policy.flow import is_past_deadline


@dataclass(slots=True)
class Live:
    """A request between its admission and its answer."""

    pending: Pending
    data: GenerationInput
    key: str  # its reply stream
    chunks: int = 0  # deltas written
    resumed_at: int = 0  # chunks another worker (or our previous process) had written
    started_ms: float | None = None  # its first step
    first_token_ms: float | None = None


class LiveRequests:
    def __init__(self, model_name: str, consumer: str, namespace: str) -> None:
        self.model_name, self.consumer, self.namespace = model_name, consumer, namespace
        self.live: dict[str, Live] = {}

    def __len__(self) -> int:
        return len(self.live)

    def ids(self) -> list[str]:
        return list(self.live)

    def add(self, pending: Pending, data: GenerationInput) -> Live:
        live = self.live[pending.entry_id] = Live(pending, data, self.key(pending))
        return live

    def entry_of(self, request_id: str | None) -> str | None:
        """The entry id of a live request, by its request id (a fork's source)."""
        return next((i for i, live in self.live.items()
                     if request_id is not None and live.pending.request.id == request_id), None)

    def forget(self, entry_id: str) -> None:
        """No answer of ours: it is no longer ours to answer."""
        self.live.pop(entry_id, None)

    def key(self, pending: Pending) -> str:
        """Its reply stream."""
        request = pending.request
        return protocol.token_stream_key(self.namespace, request.id, request.reply_to)

    def started(self, entry_ids: list[str]) -> None:
        now_ms = time.time() * 1000
        for entry_id in entry_ids:
            live = self.live[entry_id]
            live.started_ms = live.started_ms or now_ms

    def cancel_keys(self) -> dict[str, str]:
        """Every live request's cancel key, by entry id."""
        return {i: protocol.cancel_key(self.namespace, live.pending.request.id)
                for i, live in self.live.items()}

    def chunks(self, deltas: list[Delta]) -> list[Outgoing]:
        """The reply stream entries of these deltas (and their first-token times), to be
        encoded on the writer's thread."""
        now_ms = time.time() * 1000
        chunks = []
        for delta in deltas:
            live = self.live[delta.id]
            if live.first_token_ms is None:
                live.first_token_ms = now_ms
                metrics.TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(
                    (now_ms - live.pending.enqueued_ms) / 1000)
            if delta.text and live.data.stream:
                live.chunks += 1
                request = live.pending.request
                envelope = delta_envelope(request.id, live.chunks, delta.text, delta.token_ids,
                                          delta.logprobs)
                chunks.append(Outgoing(live.key, live.chunks, envelope, request.content_type))
        return chunks

    def past_deadline(self) -> list[str]:
        """Those past their `deadline_ms`."""
        now_ms = int(time.time() * 1000)
        return [i for i, live in self.live.items()
                if is_past_deadline(live.pending.request.deadline_ms, now_ms)]

    def finished(self, entry_id: str, reason: str, text: TextState,
                 logprobs: list[dict[str, Any]] | None = None) -> Answer:
        """Its success answer (the `done` entry after its chunks); it is live no more. A
        list reply carries every token's logprobs where asked (a stream's chunks did)."""
        live = self.live.pop(entry_id)
        request = live.pending.request
        meta = generation_meta(self.model_name, self.consumer, live.pending.enqueued_ms,
                               live.started_ms, live.first_token_ms, time.time() * 1000,
                               live.resumed_at)
        result = {"text": text.text, "tokens": len(text.generated),
                  "prompt_tokens": len(live.data.prompt_ids), "finish_reason": reason}
        if text.params.logprobs is not None and not live.data.stream:
            result["logprobs"] = [_public(r) for r in logprobs or []]
        metrics.GENERATIONS_FINISHED.labels(self.model_name, reason).inc()
        return final_answer(entry_id, request, protocol.success_envelope(request.id, result,
                                                                         meta),
                            self.namespace, live.data.stream, live.chunks)

    def stopped(self, entry_id: str, code: ErrorCode, message: str) -> Answer:
        """Its error answer, placed after its streamed chunks; it is live no more."""
        live = self.live.pop(entry_id)
        answer = self.error(live.pending, code, message)
        if answer.stream_index:
            answer.stream_index = live.chunks + 1
        metrics.GENERATIONS_FINISHED.labels(self.model_name, code.value).inc()
        return answer

    def error(self, pending: Pending, code: ErrorCode, message: str, after: int = 0,
              **details: str) -> Answer:
        """An error answer of a request (live or not): on its reply stream after its first
        `after` entries (its only entry by default) unless it asked for `"stream": false`;
        `details` (a `field`) go into its envelope."""
        answer = routed_error(error_answer(pending.entry_id, pending.request, code, message,
                                           **details),
                              pending.request, self.namespace, pending.item.data.stream)
        if answer.stream_index:
            answer.stream_index += after
        return answer
