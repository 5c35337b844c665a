"""The generate loop: continuous batching of a generative model, on one thread.

Between two steps it takes every request the intake queued (the batcher is its inbox) into
the scheduler (policy/decoding.py), runs a step on the engine (execution/generation.py), and
writes the step's chunks with its cancel check in one round trip, on the chunk writer's
thread while the next step runs (pipeline/chunk_writer.py). Finished requests become answers
for the reply thread (the `done` entry or list reply with the XACK, behind their chunks).
A request with a grammar waits for its compile in the gate (pipeline/grammars.py) while the
others step. On a GPU (`overlap`) step n + 1 is launched before step n's tokens are read
(a sequence that ended in step n rides along in step n + 1, its token dropped), except while
a sequence has a grammar: its mask needs its last token on the host.

Durability: a redelivered request continues from what its reply stream holds (the prompt
and the tokens streamed are prefilled; a stream with its `done` entry is only acked). Every
`keepalive_s` the loop claims its live entries to itself; one no longer ours is dropped.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import structlog

from producer.protocol import ErrorCode
from worker.execution.detokenize import Delta
from worker.execution.generation import GenerationEngine
from worker.execution.grammar_mask import constrained
from worker.execution.step_results import Launched, Unrun
from worker.models.generation_params import GenerationInput
from worker.observe import metrics
from worker.pipeline import ports
from worker.pipeline.answers import Answer, AnswerQueue
from worker.pipeline.chunk_writer import ChunkWriter
from worker.pipeline.generative_envelopes import final_answer
from worker.pipeline.grammars import HELD, GrammarCompiler, GrammarGate, GrammarRefused
from worker.pipeline.inflight import InFlight
from worker.pipeline.live_requests import Live, LiveRequests
from worker.pipeline.retry import Grace, RedisRetry
from worker.policy.batching import Batcher, Pending
from worker.policy.decoding import DecodingScheduler, SeqState, StepPlan
from worker.streams.token_streams import Progress

log = structlog.get_logger("redbatch.worker")
IDLE_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    model_name: str
    consumer: str
    namespace: str
    keepalive_s: float = 10.0  # below claim_idle_ms, so a live entry never looks idle
    overlap_steps: bool | None = None  # None: where the engine's device is a GPU


@dataclass(frozen=True, slots=True)
class Stepping:
    """A launched step, until it completes."""
    plan: StepPlan
    launched: Launched
    started: float  # perf_counter at its scheduling


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
        self.live = LiveRequests(config.model_name, config.consumer, config.namespace)
        self.gate = GrammarGate(GrammarCompiler(engine.tokenizer, engine.masks.vocab,
                                                engine.eos_ids), inflight.wake_all)
        self.steps = 0
        # on a GPU a step's host work runs while the device computes the next (not a CPU's)
        self.overlap = engine.device.type == "cuda" if config.overlap_steps is None \
            else config.overlap_steps
        self.in_flight: Stepping | None = None
        self._completed_at = 0.0  # perf_counter at the last step's completion
        self._next_keepalive = time.monotonic() + config.keepalive_s

    def run(self) -> None:
        """Step while anything runs or waits; block for work when idle; return once reading
        has stopped and nothing is left, or the shutdown grace has passed."""
        try:
            while self.take(block=not len(self.scheduler) and self.in_flight is None):
                self.keep_alive()
                self.step()
        finally:
            self.writer.close()
            self.gate.compiler.close()

    def take(self, block: bool) -> bool:
        """Move what the intake queued into the scheduler; False when the loop should end."""
        if block:  # idle: the last step's write is out first (and a failure of it raised)
            self.writer.wait()
        with self.inflight.lock:
            members, expired = self._drain()
            while block and not members and not expired and not self.gate.due():
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
        answers = [self.live.error(p, ErrorCode.DEADLINE_EXCEEDED,
                                   "deadline passed while queued") for p in expired]
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
        """Admit each (redelivered ones read their reply streams first, in one round trip)
        and those whose grammar is in."""
        again = [p for p in members if p.item.data.redelivered and p.item.data.stream]
        found = self.retry(self.streams.progress, [self.live.key(p) for p in again],
                           [p.item.data.params.max_new_tokens for p in again]) if again else []
        progress = {p.entry_id: f for p, f in zip(again, found, strict=True)}
        answers = [self._admit(p, progress.get(p.entry_id)) for p in members]
        answers += [self._admit(p, f) for p, f in self.gate.ready()]  # their grammar is in
        return [a for a in answers if a is not None]

    def _admit(self, pending: Pending, progress: Progress | None = None) -> Answer | None:
        data: GenerationInput = pending.item.data
        if progress is not None and progress.done is not None:  # answered: only the ack
            log.info("generate.already_done", entry_id=pending.entry_id)
            return final_answer(pending.entry_id, pending.request, progress.done,
                                self.config.namespace, True, progress.done_index - 1)
        prompt_len, max_new = len(data.prompt_ids), data.params.max_new_tokens
        if progress is not None and (progress.overfull
                                     or not self.engine.knows(progress.token_ids)):
            held = f"over {max_new} tokens" if progress.overfull else "tokens the model lacks"
            return self.live.error(pending, ErrorCode.INVALID_REQUEST, "its reply stream "
                                   f"holds {held}: no worker of this model wrote it",
                                   after=progress.chunks)
        if not self.scheduler.fits(prompt_len, max_new):
            return self.live.error(pending, ErrorCode.TOO_LARGE,
                               f"{prompt_len} prompt tokens + max_new_tokens {max_new} exceed "
                               f"the KV cache budget of {self.scheduler.limits.kv_tokens} "
                               "tokens (kv_cache_bytes)")
        fork = self.live.entry_of(data.fork_of) if progress is None else None  # forks.py
        try:  # held in the gate until its grammar is compiled
            if (matcher := self.gate.take(pending, progress)) is HELD:
                return None
        except GrammarRefused as exc:
            return self.live.error(pending, ErrorCode.INVALID_REQUEST, str(exc), field=exc.field)
        self.engine.add(pending.entry_id, data.prompt_ids, data.params,
                        entropy=random.getrandbits(63), fork_of=fork, matcher=matcher)
        live = self.live.add(pending, data)
        generated = len(progress.token_ids) if progress is not None and progress.chunks else 0
        if progress is not None and progress.chunks and (reason := self._resume(live, progress)):
            return self._finish(pending.entry_id, reason)  # its done entry was not out
        self.scheduler.add(SeqState(pending.entry_id, prompt_len, max_new, generated=generated,
                                    priority=pending.request.priority, after=fork))
        return None

    def _resume(self, live: Live, progress: Progress) -> str | None:
        """A redelivered request goes on after what its reply stream holds."""
        live.chunks = live.resumed_at = progress.chunks
        log.info("generate.resumed", entry_id=live.pending.entry_id, chunks=progress.chunks,
                 tokens=len(progress.token_ids))
        return self.engine.resume(live.pending.entry_id, progress.token_ids, progress.text)

    def keep_alive(self) -> None:
        """When due, claim our live entries (one call); stop those no longer ours."""
        now = time.monotonic()
        if now < self._next_keepalive or not self.live:
            return
        self._next_keepalive = now + self.config.keepalive_s
        for entry_id in self.retry(self.streams.keep_alive, self.live.ids()):
            self.live.forget(entry_id)
            self.scheduler.remove(entry_id)
            self.engine.drop(entry_id)
            self.inflight.release([entry_id])
            log.warning("generate.lost", entry_id=entry_id)

    def step(self) -> None:
        """Launch the next step, then complete the one before it (`overlap`, not while a
        sequence has a grammar) or this one at once."""
        previous, sync = self.in_flight, constrained(self.engine.seqs.values())
        if previous is not None and sync:  # a grammar's mask needs the previous tokens in
            self._complete(previous)
            previous = None
        self.in_flight = self._launch() if len(self.scheduler) else None
        if previous is not None:
            self._complete(previous)
        if (not self.overlap or sync) and self.in_flight is not None:
            launched, self.in_flight = self.in_flight, None
            self._complete(launched)

    def _launch(self) -> Stepping | None:
        """Schedule a step and start it on the device. Its tokens are counted now (a request
        at its max_new_tokens leaves the scheduler; it is answered once that token is in);
        one that ends otherwise (EOS, a stop string) is known only when the step completes,
        so with `overlap` it rides along one more step, whose token is dropped."""
        plan = self.scheduler.schedule()
        self.scheduler.update()
        started = time.perf_counter()
        self.live.started(plan.admitted)
        try:
            launched = self.engine.launch(plan, None if self.overlap else self._write_first)
        except Exception as exc:
            log.exception("generate.step_failed", sequences=len(plan.work))
            self._fail_all(exc)
            return None
        if launched.unrun is not None:
            self._out_of_memory(launched.unrun)
        return Stepping(plan, launched, started)

    def _out_of_memory(self, unrun: Unrun) -> None:
        """Part of a step ran out of device memory: recomputed in smaller steps, or answered."""
        metrics.OOM_EVENTS.labels(self.config.model_name, "step").inc()
        caps = self.scheduler.caps
        cut = caps.on_out_of_memory(unrun.tokens, len(unrun.ran_out), unrun.decoding)
        log.warning("generate.out_of_memory", sequences=len(unrun.works), cut=cut,
                    step_tokens=caps.tokens, max_seqs=caps.seqs)
        self.scheduler.recompute(unrun.works if cut else unrun.after)
        if not cut:
            message = "out of device memory even in the smallest step (one sequence, 16 tokens)"
            self.writer.write([], None, [self._stop(w.id, ErrorCode.TOO_LARGE, message)
                                         for w in unrun.ran_out])

    def _complete(self, stepping: Stepping) -> None:
        """The step's tokens in: its chunks and answers written, cancel flags applied."""
        try:
            output = self.engine.finish(stepping.launched)
        except Exception as exc:
            log.exception("generate.step_failed", sequences=len(stepping.plan.work))
            self._fail_all(exc)
            return
        self.steps += 1
        early = {d.id for d in stepping.launched.early}  # their chunks are out already
        chunks = self.live.chunks([d for d in output.deltas if d.id not in early])
        cancelled = self.writer.wait()  # the previous step's check, out while this step ran
        reasons = {d.id: d.finish_reason for d in output.deltas if d.finish_reason}
        for entry_id in reasons:
            self.scheduler.remove(entry_id)  # if still there: not at its max_new_tokens
        gone = list(reasons) + [c for c in cancelled if c not in reasons
                                and self.scheduler.remove(c)]
        answers = [self._finish(i, reasons.get(i) or "cancelled") for i in gone]
        answers += [self._stop(i, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while "
                               "generating") for i in self.live.past_deadline()]
        answers += [self._stop(i, ErrorCode.INVALID_REQUEST, f"its grammar failed: {error}")
                    for i, error in self.engine.masks.failures().items() if i in self.live.live]
        self.writer.write(chunks, self.live.cancel_keys(), answers)
        plan, now = stepping.plan, time.perf_counter()
        # overlapped, a step is timed from the previous one's completion, not its own launch
        seconds = now - max(stepping.started, self._completed_at)
        self._completed_at = now
        metrics.record_step(self.config.model_name, seconds, len(output.deltas),
                            len(plan.preempted), len(self.scheduler.running),
                            len(self.scheduler.waiting))
        log.debug("generate.step", decode=len(plan.decode), prefill=len(plan.prefill),
                  tokens=plan.tokens, preempted=len(plan.preempted), finished=len(gone))

    def _write_first(self, delta: Delta) -> None:
        """A prefilled sequence's token, queued as soon as it is sampled."""
        if chunks := self.live.chunks([delta]):
            self.writer.write(chunks)

    def _finish(self, entry_id: str, reason: str) -> Answer:
        """A sequence that ended (or was cancelled): its success answer."""
        seq = self.engine.drop(entry_id)
        assert seq is not None
        return self.live.finished(entry_id, reason, seq.text, seq.logprobs)

    def _stop(self, entry_id: str, code: ErrorCode, message: str) -> Answer:
        """End one live request with an error, placed after its streamed chunks."""
        self.scheduler.remove(entry_id)
        self.engine.drop(entry_id)
        return self.live.stopped(entry_id, code, message)

    def _fail_all(self, exc: Exception) -> None:
        """The model raised in a step: every live request is answered `model_error`."""
        self.in_flight = None  # its tokens, if any, belong to requests answered here
        message = f"{type(exc).__name__}: {exc}"
        self.writer.write([], None, [self._stop(i, ErrorCode.MODEL_ERROR, message)
                                     for i in self.live.ids()])
