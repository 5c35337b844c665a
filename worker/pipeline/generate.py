"""The generate loop: continuous batching of a generative model, on one thread.

It replaces the compute loops when the model is generative (`Model.generative`). Between two
steps it takes every request the intake queued (the batcher is its inbox: one FIFO bucket,
deadlines checked) into the scheduler (policy/decoding.py), runs a step on the engine
(execution/generation.py), and writes the step's text chunks with its cancel check in one
round trip (streams/token_streams.py), on the chunk writer's thread while the next step runs
(pipeline/chunk_writer.py); a prefilled request's first chunk is queued as soon as its own
forward is done. Finished requests become answers for the reply thread, which writes the
`done` entry (or the list reply) with the XACK, ownership-checked; they are queued behind
their chunks, so a `done` entry never overtakes them.

Durability: a redelivered request (claimed from a dead consumer, or our own after a restart)
continues from what its reply stream holds: the prompt and the tokens already streamed are
prefilled and it goes on at the next chunk index; a stream with its `done` entry is only
acked. Every `keepalive_s` the loop claims its live entries to itself, so none looks idle
to another worker's reclaimer while it runs; one that is no longer ours is abandoned.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import structlog

from producer import protocol
from producer.protocol import ErrorCode
from worker.execution.detokenize import Delta
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import GenerationInput
from worker.observe import metrics
from worker.pipeline import ports
from worker.pipeline.answers import Answer, AnswerQueue, error_answer
from worker.pipeline.chunk_writer import ChunkWriter, Outgoing
from worker.pipeline.generative_envelopes import (
    delta_envelope,
    final_answer,
    generation_meta,
    routed_error,
)
from worker.pipeline.inflight import InFlight
from worker.pipeline.retry import Grace, RedisRetry
from worker.policy.batching import Batcher, Pending
from worker.policy.decoding import DecodingScheduler, SeqState, StepPlan
from worker.policy.flow import entry_time_ms, is_past_deadline
from worker.streams.token_streams import Progress

log = structlog.get_logger("redbatch.worker")
IDLE_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    model_name: str
    consumer: str
    namespace: str
    keepalive_s: float = 10.0  # below claim_idle_ms, so a live entry never looks idle


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


class GenerateLoop:
    def __init__(self, config: GenerateConfig, engine: GenerationEngine,
                 scheduler: DecodingScheduler, batcher: Batcher, inflight: InFlight,
                 answers: AnswerQueue, grace: Grace, streams: ports.TokenStreams,
                 retry: RedisRetry) -> None:
        self.config = config
        self.engine, self.scheduler, self.batcher = engine, scheduler, batcher
        self.inflight, self.answers, self.grace = inflight, answers, grace
        self.streams, self.retry = streams, retry
        self.writer = ChunkWriter(streams, retry, answers)
        self.live: dict[str, Live] = {}
        self.steps = 0
        self._next_keepalive = time.monotonic() + config.keepalive_s

    def run(self) -> None:
        """Step while anything runs or waits; block for work when idle; return once
        reading has stopped and nothing is left, or the shutdown grace has passed."""
        try:
            while self.take(block=not len(self.scheduler)):
                self.keep_alive()
                if len(self.scheduler):
                    self.step()
        finally:
            self.writer.close()

    # --- intake side --------------------------------------------------------------------------

    def take(self, block: bool) -> bool:
        """Move what the intake queued into the scheduler; False when the loop should end."""
        if block:  # idle: the last step's write is out first (and a failure of it raised)
            self.writer.wait()
        with self.inflight.lock:
            members, expired = self._drain()
            while block and not members and not expired:
                if not self.inflight.reading or self.grace.left() <= 0:
                    return False
                self.inflight.idle += 1
                try:
                    self.inflight.work.wait(IDLE_POLL_S)
                finally:
                    self.inflight.idle -= 1
                members, expired = self._drain()
        if self.grace.left() <= 0:
            return False
        answers = [self._error(p, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                   for p in expired]
        answers += self._admit_all(members)
        if answers:
            self.answers.put(answers)
        return True

    def _drain(self) -> tuple[list[Pending], list[Pending]]:
        """With the lock held: every request the batcher holds, and those past deadline."""
        members: list[Pending] = []
        expired: list[Pending] = []
        now_ms = int(time.time() * 1000)
        while (batch := self.batcher.next_batch(time.monotonic(), now_ms, True)) is not None:
            if not batch.members and not batch.expired:
                break
            members += batch.members
            expired += batch.expired
        return members, expired

    def _admit_all(self, members: list[Pending]) -> list[Answer]:
        """Admit each; redelivered streamed ones first read their reply streams (one round
        trip for all) to resume where they were."""
        again = [p for p in members if p.item.data.redelivered and p.item.data.stream]
        found = self.retry(self.streams.progress, [self._key(p) for p in again]) if again \
            else []
        progress = {p.entry_id: f for p, f in zip(again, found, strict=True)}
        answers = [self._admit(p, progress.get(p.entry_id)) for p in members]
        return [a for a in answers if a is not None]

    def _key(self, pending: Pending) -> str:
        request = pending.request
        return protocol.token_stream_key(self.config.namespace, request.id, request.reply_to)

    def _admit(self, pending: Pending, progress: Progress | None = None) -> Answer | None:
        data: GenerationInput = pending.item.data
        if progress is not None and progress.done is not None:  # answered: only the ack
            log.info("generate.already_done", entry_id=pending.entry_id)
            return final_answer(pending.entry_id, pending.request, progress.done,
                                self.config.namespace, True, progress.done_index - 1)
        prompt_len, max_new = len(data.prompt_ids), data.params.max_new_tokens
        if not self.scheduler.fits(prompt_len, max_new):
            return self._error(pending, ErrorCode.TOO_LARGE,
                               f"{prompt_len} prompt tokens + max_new_tokens {max_new} exceed "
                               f"the KV cache budget of {self.scheduler.limits.kv_tokens} "
                               "tokens (kv_cache_bytes)")
        request = pending.request
        self.engine.add(pending.entry_id, data.prompt_ids, data.params,
                        entropy=random.getrandbits(63))
        live = self.live[pending.entry_id] = Live(pending, data, self._key(pending))
        generated = 0
        if progress is not None and progress.chunks:
            live.chunks = live.resumed_at = progress.chunks
            generated = len(progress.token_ids)
            log.info("generate.resumed", entry_id=pending.entry_id, chunks=progress.chunks,
                     tokens=generated)
            reason = self.engine.resume(pending.entry_id, progress.token_ids, progress.text)
            if reason is not None:  # its last chunk was out, its done entry was not
                return self._finish(pending.entry_id, reason)
        self.scheduler.add(SeqState(pending.entry_id, prompt_len, max_new,
                                    priority=request.priority, generated=generated))
        return None

    def keep_alive(self) -> None:
        """When due, claim our live entries to ourselves (one call); stop those that are
        no longer ours (claimed by another worker while we were frozen, or acked)."""
        now = time.monotonic()
        if now < self._next_keepalive or not self.live:
            return
        self._next_keepalive = now + self.config.keepalive_s
        for entry_id in self.retry(self.streams.keep_alive, list(self.live)):
            self.live.pop(entry_id, None)
            self.scheduler.remove(entry_id)
            self.engine.drop(entry_id)
            self.inflight.release([entry_id])
            log.warning("generate.lost", entry_id=entry_id)

    def _error(self, pending: Pending, code: ErrorCode, message: str) -> Answer:
        answer = error_answer(pending.entry_id, pending.request, code, message)
        return routed_error(answer, pending.request, self.config.namespace,
                            pending.item.data.stream)

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> None:
        plan = self.scheduler.schedule()
        started, now_ms = time.perf_counter(), time.time() * 1000
        for entry_id in plan.admitted:
            live = self.live[entry_id]
            live.started_ms = live.started_ms or now_ms
        early: set[str] = set()
        try:
            output = self.engine.step(plan, lambda delta: self._write_first(delta, early))
        except Exception as exc:
            log.exception("generate.step_failed", sequences=len(plan.work))
            self._fail_all(plan, exc)
            return
        self.steps += 1
        chunks = self._chunks([d for d in output.deltas if d.id not in early])
        cancelled = self.writer.wait()  # the previous step's check, out while this step ran
        reasons = {d.id: d.finish_reason for d in output.deltas if d.finish_reason}
        gone = [s.id for s in self.scheduler.update(output.finished)]
        gone += [c for c in cancelled if c not in gone and self.scheduler.remove(c)]
        answers = [self._finish(i, reasons.get(i) or "cancelled") for i in gone]
        answers += self._expire()
        self.writer.write(chunks, self._cancel_keys(), answers)
        metrics.record_step(self.config.model_name, time.perf_counter() - started,
                            len(output.deltas), len(plan.preempted),
                            len(self.scheduler.running), len(self.scheduler.waiting))
        log.debug("generate.step", decode=len(plan.decode), prefill=len(plan.prefill),
                  tokens=plan.tokens, preempted=len(plan.preempted), finished=len(gone))

    def _write_first(self, delta: Delta, early: set[str]) -> None:
        """A prefilled sequence's token, queued as soon as it is sampled (mid-step)."""
        early.add(delta.id)
        if chunks := self._chunks([delta]):
            self.writer.write(chunks)

    def _cancel_keys(self) -> dict[str, str]:
        """Every live request's cancel key, by entry id."""
        return {i: protocol.cancel_key(self.config.namespace, live.pending.request.id)
                for i, live in self.live.items()}

    def _chunks(self, deltas: list[Delta]) -> list[Outgoing]:
        """The reply stream entries of these deltas (and their first-token times), to be
        encoded on the writer's thread."""
        now_ms = time.time() * 1000
        chunks = []
        for delta in deltas:
            live = self.live[delta.id]
            if live.first_token_ms is None:
                live.first_token_ms = now_ms
                metrics.TIME_TO_FIRST_TOKEN.labels(self.config.model_name).observe(
                    (now_ms - entry_time_ms(delta.id)) / 1000)
            if delta.text and live.data.stream:
                live.chunks += 1
                request = live.pending.request
                envelope = delta_envelope(request.id, live.chunks, delta.text, delta.token_ids)
                chunks.append(Outgoing(live.key, live.chunks, envelope, request.content_type))
        return chunks

    def _finish(self, entry_id: str, reason: str) -> Answer:
        live = self.live.pop(entry_id)
        seq = self.engine.drop(entry_id)
        assert seq is not None
        request, config = live.pending.request, self.config
        meta = generation_meta(config.model_name, config.consumer, entry_id, live.started_ms,
                               live.first_token_ms, time.time() * 1000, live.resumed_at)
        result = {"text": seq.text.text, "tokens": len(seq.text.generated),
                  "prompt_tokens": len(live.data.prompt_ids), "finish_reason": reason}
        metrics.GENERATIONS_FINISHED.labels(config.model_name, reason).inc()
        return final_answer(entry_id, request, protocol.success_envelope(request.id, result,
                                                                         meta),
                            config.namespace, live.data.stream, live.chunks)

    def _expire(self) -> list[Answer]:
        """Running or waiting sequences past their `deadline_ms`: stopped, answered
        `deadline_exceeded` (after the chunks already streamed)."""
        now_ms = int(time.time() * 1000)
        late = [i for i, live in self.live.items()
                if is_past_deadline(live.pending.request.deadline_ms, now_ms)]
        return [self._stop(i, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while generating")
                for i in late]

    def _stop(self, entry_id: str, code: ErrorCode, message: str) -> Answer:
        """End one live request with an error, placed after its streamed chunks."""
        live = self.live.pop(entry_id)
        self.scheduler.remove(entry_id)
        self.engine.drop(entry_id)
        answer = self._error(live.pending, code, message)
        if answer.stream_index:
            answer.stream_index = live.chunks + 1
        metrics.GENERATIONS_FINISHED.labels(self.config.model_name, code.value).inc()
        return answer

    def _fail_all(self, plan: StepPlan, exc: Exception) -> None:
        """The model raised in a step: every live request is answered `model_error`
        (the step may have left their caches half-updated)."""
        self.scheduler.update()
        message = f"{type(exc).__name__}: {exc}"
        self.writer.write([], None, [self._stop(i, ErrorCode.MODEL_ERROR, message)
                                     for i in list(self.live)])
