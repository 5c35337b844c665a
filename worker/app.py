"""The composition root: connect to (or embed) Redis, load the model, build the worker.

Every part the worker runs with is built here, from the settings, and handed to it built
(pipeline/worker.py wires the threads and builds nothing). The `run` command
(commands/run.py) serves what this returns until a signal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
import structlog
import torch

from producer import connection, protocol
from producer.replicas import ReplicaCount
from worker.execution import cuda_graphs
from worker.execution.calibration import (
    CalibrationError,
    Observe,
    calibrated_sizes,
    calibration_path,
    measure_merge_tokens,
    warm_up,
)
from worker.execution.executor import Executor
from worker.execution.generation import engine_for
from worker.execution.guarded_runner import BatchRunner
from worker.execution.memory import MemoryProbe, memory_probe
from worker.model_loading import load_model, resolve_layout
from worker.models import Model
from worker.models.generative import CausalLM
from worker.observe.startup import logged_step
from worker.pipeline.worker import GenerationParts, Parts, Worker
from worker.policy.background import BackgroundPacing
from worker.policy.batching import Batcher, BatchLimits
from worker.policy.controllers import controlled, controller_from_settings, dispatch_rule
from worker.policy.decoding import DecodingScheduler
from worker.policy.device_defaults import default_boundaries, on_device
from worker.policy.governor import (
    Governor,
    MemoryReading,
    kv_cache_budget,
    policy_from_settings,
)
from worker.policy.latency import LatencyPolicy
from worker.policy.layout import Layout
from worker.policy.targeted import TargetedDispatch
from worker.settings import Settings
from worker.startup_error import StartupError
from worker.streams import sharding
from worker.streams.id_claims import IdClaims
from worker.streams.maintenance import Maintenance
from worker.streams.reader import StreamReader
from worker.streams.reclaimer import Reclaimer
from worker.streams.replier import Replier
from worker.streams.token_streams import TokenStreams

log = structlog.get_logger("redbatch")
UNMEASURED_MERGE_TOKENS = 32  # a small encoder's on CPU, until warm-up measures the model's


def connect(url: str, block_ms: int, attempts: int = 3, cluster: bool = False,
            password: str | None = None) -> redis.Redis:
    """A client (single, Sentinel or Cluster: producer/connection.py) whose socket timeout
    outlasts the blocking read; fails clearly if the URL is bad or Redis unreachable.
    `password`: Settings.redis_secret, for a URL without one."""
    try:
        client: redis.Redis = connection.sync_client(
            url, cluster, socket_timeout=block_ms / 1000 + 10, socket_connect_timeout=5,
            health_check_interval=30, socket_read_size=1 << 20, password=password)
    except connection.ConnectionSettingsError as exc:
        raise StartupError(str(exc)) from None
    except redis.RedisError as exc:  # a cluster client connects at once
        raise StartupError(f"cannot reach Redis at {connection.redacted(url)}: {exc}",
                           ("redis_url",)) from None
    for attempt in range(attempts):
        try:
            client.ping()
            return client
        except redis.RedisError as exc:
            if attempt == attempts - 1:
                raise StartupError(f"cannot reach Redis at {connection.redacted(url)}: "
                                   f"{exc}", ("redis_url",)) from None
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def assemble_worker(settings: Settings, model: Model, executor: Executor,
                    client: redis.Redis, calibrated: Mapping[int, int] | None = None) -> Worker:
    """The composition root: build every part from the settings and hand them, built, to
    the Worker. `calibrated`: the best batch size per bucket boundary, from `python -m
    worker calibrate`; it lowers max_batch_size for that bucket."""
    settings = on_device(settings, executor.device.type)  # e.g. a GPU's larger batches
    layout = resolve_layout(settings, model, executor.device)
    boundaries = settings.bucket_boundaries
    if boundaries is None:
        boundaries = default_boundaries(model.default_bucket_boundaries, executor.device.type)
    limits = BatchLimits(settings.max_batch_size, settings.max_batch_tokens,
                         settings.max_wait_ms / 1000)
    governor = build_governor(settings, limits, boundaries, calibrated or {})
    controller = controller_from_settings(settings)  # a baseline (issue 13), usually none
    if settings.batch_controller != "static" and model.generative:
        raise StartupError("batch_controller applies to batch models, not generative ones")
    batch_limits, caps = controlled(limits, governor.limits, controller)
    targeted = TargetedDispatch(LatencyPolicy(
        settings.latency_target_ms or float("inf"), settings.latency_percentile,
        len(boundaries) + 1, layout.instances, settings.shed_over_target))
    lock = threading.Lock()  # the worker's one lock: batcher, governor, in-flight state
    memory = memory_probe(executor.device, settings.memory_limit_bytes)
    executors = [executor] + [executor.another() for _ in range(layout.instances - 1)]
    batcher = Batcher(boundaries, batch_limits, caps, targeted=dispatch_rule(settings, targeted),
                      **background_of(settings))
    parts = Parts(
        **redis_parts(settings, client, describe_worker(settings, layout, model, executor.device,
                                                          targeted, batcher.background, lock)),
        batcher=batcher,
        governor=governor, controller=controller,
        ids=IdClaims(client, settings.namespace, settings.result_ttl_ms),
        runners=[BatchRunner(e, governor, memory, settings.model_name, governing=lock)
                 for e in executors],
        layout=layout, targeted=targeted,
        generation=generation_parts(settings, model, client, memory) if model.generative
        else None)
    worker = Worker(settings, model, parts, lock)
    worker.set_merge_tokens(UNMEASURED_MERGE_TOKENS if settings.merge_tokens is None
                            else settings.merge_tokens)
    return worker


def background_of(settings: Settings) -> dict[str, Any]:
    """How background requests (batch jobs' lines) share the device with online ones."""
    return {"background_rows": settings.background_rows,
            "background_quiet_ms": settings.background_quiet_ms,
            "background_share": settings.background_share}


def generation_parts(settings: Settings, model: Model, client: redis.Redis,
                     memory: MemoryProbe) -> GenerationParts:
    """A generative model's engine, scheduler and reply streams (models/generative.py);
    its KV pool fits under the memory governor's high watermark."""
    assert isinstance(model, CausalLM), "generative models derive from CausalLM"
    fit_kv_cache(model, memory.read(), settings.memory_high_watermark)
    stream = protocol.stream_key(settings.namespace, settings.model_name)
    streams: sharding.AnyTokenStreams = sharding.sharded_token_streams(settings, client) \
        if connection.is_cluster_client(client) else TokenStreams(
            client, stream, settings.group, settings.consumer, settings.result_ttl_ms,
            protocol.answered_key(settings.namespace, settings.model_name), settings.model_name,
            ReplicaCount(settings.replicas_to_wait, settings.replicas_wait_ms))
    return GenerationParts(engine_for(model, settings.cuda_graphs),
                           DecodingScheduler(model.scheduler_limits()),
                           streams, model.overlap_steps)


def fit_kv_cache(model: CausalLM, reading: MemoryReading, high_watermark: float) -> None:
    """Lower the model's KV budget to what the watermark leaves; refuse to start when
    that is not even one step's worth of tokens."""
    configured = model.limits.kv_budget_bytes
    budget = kv_cache_budget(configured, reading, high_watermark)
    if budget == configured:
        return
    tokens = budget // model.scheduler_limits().bytes_per_token
    if tokens < model.limits.max_step_tokens:
        raise StartupError(
            f"the KV cache would get {budget >> 20} MiB ({tokens} tokens): "
            f"{reading.used >> 20} MiB are in use of a {reading.limit >> 20} MiB limit at the "
            f"high watermark {high_watermark}; lower max_step_tokens or raise "
            "memory_limit_bytes")
    model.limit_kv_cache(budget)
    log.warning("generate.kv_cache_lowered", configured_mib=configured >> 20,
                budget_mib=budget >> 20, used_mib=reading.used >> 20,
                limit_mib=reading.limit >> 20)


def redis_parts(settings: Settings, client: redis.Redis,
                describe: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
    """The parts that talk to Redis (streams/), each on the model's request stream; on a
    Redis Cluster one of each per shard (streams/sharding.py)."""
    if connection.is_cluster_client(client):
        try:
            return sharding.sharded_parts(settings, client, describe)
        except ValueError as exc:  # a brace in a name, a bad published shard count
            raise StartupError(str(exc)) from None
    name, ns = settings.model_name, settings.namespace
    stream = protocol.stream_key(ns, name)
    group, consumer = settings.group, settings.consumer
    reclaimer = Reclaimer(client, stream, group, consumer, settings.claim_idle_ms, name)
    return dict(
        reader=StreamReader(client, stream, group, consumer),
        replier=Replier(client, stream, group, consumer, settings.result_ttl_ms,
                        protocol.answered_key(settings.namespace, name),
                        replicas=ReplicaCount(settings.replicas_to_wait,
                                                         settings.replicas_wait_ms)),
        reclaimer=reclaimer,
        dead_letters=sharding.dead_letters_of(settings, client, stream),
        maintenance=Maintenance(client, stream, group, name, reclaimer,
                                settings.maintenance_interval_s, settings.consumer_idle_ms,
                                describe, protocol.workers_key(ns, name), protocol.models_key(ns),
                                protocol.internal_keys(ns, name)))


def describe_worker(settings: Settings, layout: Layout, model: Model, device: torch.device,
                    targeted: TargetedDispatch, background: BackgroundPacing,
                    lock: threading.Lock) -> Callable[[], dict[str, Any]]:
    """What `stats` shows of this worker: its layout and why, its device, and with a
    latency target the observed percentile, the margin and the share of the time batch
    jobs' lines may take, steered by them (read under the worker's lock)."""
    static = {"layout": layout.describe(), "reason": layout.reason, "device": str(device),
              "dtype": model.precision_name, "dtype_why": model.dtype_reason,
              "model": settings.model,
              "kind": model.announced_kind().value, "started_ms": int(time.time() * 1000)}
    policy = targeted.policy
    if not settings.latency_target_ms:
        return lambda: static

    def describe() -> dict[str, Any]:
        with lock:
            observed, margin = policy.margin.observed.value(0.0), policy.margin.ms
            share = background.share
        return {**static, "latency": {"target_ms": policy.target_ms, "observed_ms": observed,
                                      "percentile": settings.latency_percentile,
                                      "margin_ms": margin, "batch_share": share}}

    return describe


def build_governor(settings: Settings, limits: BatchLimits, boundaries: Sequence[int],
                   calibrated: Mapping[int, int]) -> Governor:
    """One cap per bucket; a calibrated bucket starts at its calibrated batch size."""
    sizes = {i: calibrated[b] for i, b in enumerate(boundaries) if b in calibrated}
    return Governor(limits, len(boundaries) + 1, policy_from_settings(settings), sizes)


def build_worker(settings: Settings, client: redis.Redis) -> Worker:
    """Load the model, assemble and warm up the worker (a target's model: warm runs only)."""
    model, device = load_model(settings)
    try:  # the best batch size per bucket, when calibrated on this device in this dtype
        calibrated = calibrated_sizes(calibration_path(
            settings.calibration_dir, settings.model_name, device, model.precision_name))
    except CalibrationError as exc:
        raise StartupError(str(exc)) from None
    worker = assemble_worker(settings, model, Executor(model, device), client, calibrated)
    if settings.cuda_graphs:  # before warm-up, which then runs the graphs too
        resolved = worker.settings  # the device's defaults applied
        cuda_graphs.install([runner.executor for runner in worker.runners], model, device,
                            worker.batcher.boundaries, resolved.max_batch_size,
                            resolved.max_batch_tokens, "cuda_graphs" in settings.model_fields_set)
    if settings.warmup:
        policy = worker.intake.targeted.policy
        observe = policy.model.observe if settings.latency_target_ms else None
        with logged_step("warmup", end=False, model=settings.model):
            warm_up(worker.runner, model, worker.batcher.boundaries, observe)
            if settings.merge_tokens is None and worker.batcher.boundaries:
                measure_merge(worker, model, observe)
    return worker


def measure_merge(worker: Worker, model: Model, observe: Observe | None) -> None:
    """Set how much padding a merge of buckets may add from the model's measured costs."""
    try:
        measured = measure_merge_tokens(worker.runner, model, worker.batcher.boundaries[0],
                                        observe=observe)
    except Exception:  # only a tuning: serve with the default, the error will show again
        log.exception("batching.merge_tokens_failed")
        return
    if measured is not None:
        worker.set_merge_tokens(measured)
    log.debug("batching.merge_tokens", merge_tokens=worker.batcher.merge_tokens,
             measured=measured is not None)
