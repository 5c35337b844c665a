"""The worker: threads joined by the bucketed batcher and the answer queue.

    intake thread     XREADGROUP -> divert -> parse, claim ids -> prepare stage   (intake.py)
    prepare thread    decode -> model.prepare_many -> Batcher   (prepare_stage.py; on a CPU:
                      the intake thread, between its reads)
    compute thread(s) Batcher.next_batch -> BatchRunner (the model)   -> answers   (compute.py)
    reply thread      encode -> Lua reply+ack -> free in-flight slots              (reply.py)
    maintenance       trim, backlog, idle consumers          (streams/maintenance.py)

There is one compute thread per model instance (`instances`): they take batches from the
one batcher, like several servers at one counter, and share the weights and the governor.
The Worker receives its parts already built (app.assemble_worker) and only wires the
threads; it owns the one lock, which guards the batcher, the governor and the in-flight
state. The decisions the threads make around it are pure policy (policy/flow.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis
import structlog

from worker.execution.generation import GenerationEngine
from worker.execution.guarded_runner import BatchRunner
from worker.models.base import Model
from worker.observe import metrics
from worker.pipeline import ports
from worker.pipeline.answers import AnswerQueue
from worker.pipeline.compute import ComputeConfig, ComputeLoop
from worker.pipeline.generate import GenerateConfig, GenerateLoop
from worker.pipeline.inflight import InFlight
from worker.pipeline.intake import Intake, IntakeConfig
from worker.pipeline.reply import ReplyWriter
from worker.pipeline.retry import Grace, RedisRetry, ShutdownExpired
from worker.policy.batching import Batcher
from worker.policy.controllers import BatchController
from worker.policy.decoding import DecodingScheduler
from worker.policy.flow import FlowPolicy
from worker.policy.governor import Governor
from worker.policy.layout import Layout
from worker.policy.targeted import TargetedDispatch
from worker.settings import Settings
from worker.streams.id_claims import IdClaims
from worker.streams.maintenance import Maintenance

log = structlog.get_logger("redbatch.worker")


@dataclass(frozen=True, slots=True)
class GenerationParts:
    """What the composition root builds for a generative model."""

    engine: GenerationEngine
    scheduler: DecodingScheduler
    streams: ports.TokenStreams
    overlap_steps: bool | None = None  # None: where the engine's device is a GPU


@dataclass(frozen=True)
class Parts:
    """Everything the worker wires together, built by the composition root (app.py)."""

    reader: ports.Reader  # on a Redis Cluster, the sharded twins (streams/shards.py)
    replier: ports.Replies
    reclaimer: ports.Reclaims
    dead_letters: ports.DeadLetters
    maintenance: Maintenance
    batcher: Batcher
    governor: Governor
    runners: list[BatchRunner]  # one per model instance, sharing `lock` for the governor
    layout: Layout  # the instances and threads the runners were built for
    targeted: TargetedDispatch  # latency predictions; the batcher dispatches by it if targeted
    ids: IdClaims  # refuses a second entry with an id in flight on the same reply key
    generation: GenerationParts | None = None  # a generative model: the generate loop's parts
    controller: BatchController | None = None  # a baseline's limits controller (issue 13)


def prepares_on_a_thread(runners: list[BatchRunner]) -> bool:
    """Tokenise on the prepare stage's thread when the model runs on an accelerator: there
    the host's cores are free while the device computes, and the next read overlaps this
    one's tokenising. On a CPU the model's forward and the tokenizer's pool already take
    every core, and the thread measured no gain (bench.throughput.host_path --inline): the reader
    tokenises between its reads, as before."""
    return any(runner.executor.device.type != "cpu" for runner in runners)


class Worker:
    def __init__(self, settings: Settings, model: Model, parts: Parts,
                 lock: threading.Lock) -> None:
        self.settings = settings
        self.model = model
        self.name = settings.model_name
        self.reader, self.replier = parts.reader, parts.replier
        self.maintenance = parts.maintenance
        self.batcher, self.governor, self.runners = parts.batcher, parts.governor, parts.runners
        self.layout = parts.layout
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.failed = False
        self.inflight = InFlight(lock, FlowPolicy(settings.max_inflight, settings.read_count))
        self.grace = Grace()
        self.retry = RedisRetry(self.grace, on_fault=self._drain_own_pending_again)
        answers = AnswerQueue()
        self.answers = answers
        self.intake = Intake(
            IntakeConfig(self.name, settings.namespace, settings.max_payload_bytes,
                         settings.block_ms, tuple(settings.reply_prefixes),
                         prepare_thread=prepares_on_a_thread(parts.runners)),
            model, parts.reader, parts.reclaimer, parts.dead_letters, parts.replier,
            parts.batcher, self.inflight, answers, self.retry, parts.targeted, parts.ids)
        config = ComputeConfig(self.name, settings.consumer)
        latency = parts.targeted.policy
        self.computes: list[ComputeLoop | GenerateLoop] = [
            ComputeLoop(config, runner, parts.batcher, self.inflight, answers, self.grace,
                        latency, instance, parts.controller)
            for instance, runner in enumerate(parts.runners)]
        if parts.generation is not None:  # continuous batching replaces the compute loops
            self.computes = [self._generate_loop(parts.generation, parts.batcher)]
        self.reply = ReplyWriter(self.name, parts.replier, self.inflight, answers, self.retry,
                                 latency if settings.latency_target_ms else None,
                                 parts.generation.streams if parts.generation else None)

    def _generate_loop(self, generation: GenerationParts, batcher: Batcher) -> GenerateLoop:
        config = GenerateConfig(self.name, self.settings.consumer, self.settings.namespace,
                                keepalive_s=self.settings.claim_idle_ms / 3000,
                                overlap_steps=generation.overlap_steps)
        return GenerateLoop(config, generation.engine, generation.scheduler, batcher,
                            self.inflight, self.answers, self.grace, generation.streams,
                            self.retry)

    # --- lifecycle ----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop() is called, then answer everything held and return."""
        self.retry(self.reader.ensure_group)
        self.retry(self.maintenance.check_keys)
        self.retry(self.maintenance.announce)
        intake = self._thread("redbatch-reader", self._intake_thread)
        replier = self._thread("redbatch-replier", self._reply_thread)
        self._thread("redbatch-maintenance", self.maintenance.run, self.stopping)
        instances = [self._thread(f"redbatch-compute-{index}", self._compute_thread, compute)
                     for index, compute in enumerate(self.computes[1:], start=1)]
        if self.settings.latency_target_ms:
            metrics.LATENCY_TARGET.labels(self.name).set(self.settings.latency_target_ms / 1000)
        self.ready.set()
        generating = self.computes[0]
        steps = {"overlapped_steps": generating.overlap} \
            if isinstance(generating, GenerateLoop) else {}
        log.info("worker.serving", stream=self.reader.stream, group=self.settings.group,
                 consumer=self.settings.consumer, buckets=self.batcher.boundaries,
                 instances=len(self.runners), threads=self.layout.threads,
                 dtype=self.model.precision_name, dtype_why=self.model.dtype_reason,
                 layout=self.layout.reason, latency_target_ms=self.settings.latency_target_ms,
                 batch_controller=self.settings.batch_controller, **steps)
        try:
            self._compute_thread(self.computes[0])  # the first instance computes here
        finally:
            for instance in instances:
                instance.join()
            self.answers.close()
            replier.join()
            intake.join()
            self._leave()

    def _leave(self) -> None:
        """Delete this consumer and its announcement where it holds nothing (a clean stop),
        so `stats` and the gateway stop counting it at once."""
        try:
            left = self.maintenance.leave()
        except redis.RedisError as exc:
            log.warning("worker.leave_failed", error=str(exc),
                        hint="the consumer is removed once idle (consumer_idle_ms)")
            left = False
        log.info("worker.stopped", consumer=self.settings.consumer, left_group=left)

    def stop(self) -> None:
        """Stop reading; what is held is answered until `shutdown_grace_s` has passed."""
        self.grace.start(self.settings.shutdown_grace_s)
        self.stopping.set()
        self.inflight.wake_all()

    @property
    def runner(self) -> BatchRunner:
        """The first instance's runner: warm-up and calibration measure this one."""
        return self.runners[0]

    def set_merge_tokens(self, merge_tokens: int) -> None:
        """How much padding a merge of buckets may add (batching.py); warm-up measures it."""
        self.batcher.merge_tokens = merge_tokens
        metrics.MERGE_TOKENS.labels(self.name).set(merge_tokens)

    def load(self) -> tuple[int, list[int]]:
        """Entries held (read, not yet answered) and requests queued per bucket, for metrics."""
        with self.inflight.lock:
            return len(self.inflight.held), [len(b.items) for b in self.batcher.buckets]

    # --- the threads --------------------------------------------------------------------------

    @staticmethod
    def _thread(name: str, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def _intake_thread(self) -> None:
        try:
            self.intake.run(self.stopping)
        except ShutdownExpired:
            pass
        except Exception:
            self._fail("reader")

    def _compute_thread(self, compute: ComputeLoop | GenerateLoop) -> None:
        """One model instance's loop; a bug in it stops the worker with a failure status."""
        try:
            compute.run()
        except Exception:
            self._fail(threading.current_thread().name)

    def _reply_thread(self) -> None:
        try:
            self.reply.run()
        except ShutdownExpired:
            log.warning("worker.grace_expired", left_pending=len(self.inflight.held))
        except Exception:
            self._fail("replier")

    def _fail(self, thread: str) -> None:
        """A bug or an unexpected Redis reply in a worker thread: stop with a failure status
        rather than hang. Entries not yet answered stay pending, for this worker's restart
        or another worker to claim."""
        log.exception("worker.thread_failed", thread=thread)
        self.failed = True
        self.stop()

    def _drain_own_pending_again(self) -> None:
        """A Redis fault: a lost reply may have delivered entries to us."""
        self.reader.draining_own_pending = True
