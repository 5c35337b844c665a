"""Process-level wiring: connect to (or embed) Redis, load the model, serve until a signal."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import redis
import structlog
import torch

from worker.execution.calibration import (
    CalibrationError,
    calibrate,
    calibration_path,
    load_calibration,
    measure_merge_tokens,
    warm_up,
    write_calibration,
)
from worker.execution.executor import DEFAULT_TORCH_THREADS, Executor, resolve_device
from worker.execution.memory import memory_probe
from worker.models import Model, ModelLoadError, create_model
from worker.observe import metrics
from worker.observe.health import Readiness
from worker.observe.sampler import Sampler
from worker.pipeline.worker import Worker
from worker.settings import Settings, threads_per_instance
from worker.streams.server import RedisServer

log = structlog.get_logger("redbatch")
GRACE_MARGIN_S = 2.0  # beyond shutdown_grace_s, for the last blocking read to return


class StartupError(Exception):
    """The worker cannot start; the message says why, for the user."""


def connect(url: str, block_ms: int, attempts: int = 3) -> redis.Redis:
    """A client whose socket timeout outlasts the blocking read; fails clearly if unreachable."""
    client = redis.Redis.from_url(url, socket_timeout=block_ms / 1000 + 10,
                                  socket_connect_timeout=5, health_check_interval=30,
                                  socket_read_size=1 << 20)
    for attempt in range(attempts):
        try:
            client.ping()
            return client
        except redis.RedisError as exc:
            if attempt == attempts - 1:
                raise StartupError(f"cannot reach Redis at {url}: {exc}") from None
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


@contextmanager
def redis_url(settings: Settings) -> Iterator[str]:
    """The configured Redis, or an embedded redis-server for the duration of the block."""
    if settings.redis_url:
        yield settings.redis_url
        return
    with RedisServer(settings.data_dir / "redis") as server:
        log.info("redis.embedded", url=server.url, hint="set REDBATCH_REDIS_URL to use your own")
        yield server.url


def load_model(settings: Settings) -> tuple[Model, torch.device]:
    try:
        model = create_model(settings.model, settings.model_options)
        device = resolve_device(settings.device)
    except (ModelLoadError, ValueError) as exc:
        raise StartupError(str(exc)) from None
    torch.set_num_threads(threads_per_instance(settings.torch_threads, DEFAULT_TORCH_THREADS,
                                               settings.instances))
    started = time.perf_counter()
    try:
        model.load(device)
    except Exception as exc:  # plugin code: any failure to load is a start-up error
        raise StartupError(f"cannot load model {settings.model!r}: "
                           f"{type(exc).__name__}: {exc}") from None
    log.info("model.loaded", model=settings.model, device=str(device),
             seconds=round(time.perf_counter() - started, 2))
    return model, device


def load_batch_sizes(settings: Settings, device: torch.device) -> dict[int, int] | None:
    """The calibrated batch size per bucket boundary, when this model was calibrated here."""
    path = calibration_path(settings.calibration_dir, settings.model_name, device)
    try:
        sizes = load_calibration(path)
    except CalibrationError as exc:
        raise StartupError(str(exc)) from None
    if sizes is None:
        log.info("calibration.none", path=str(path), hint="python -m worker calibrate")
    else:
        log.info("calibration.loaded", path=str(path), batch_sizes=sizes)
    return sizes


def build_worker(settings: Settings, client: redis.Redis) -> Worker:
    model, device = load_model(settings)
    worker = Worker(settings, model, Executor(model, device), client,
                    calibrated=load_batch_sizes(settings, device))
    if settings.warmup:
        warm_up(worker.runner, model, worker.batcher.boundaries)
        if settings.merge_tokens is None and worker.batcher.boundaries:
            measure_merge(worker, model)
    return worker


def measure_merge(worker: Worker, model: Model) -> None:
    """Set how much padding a merge of buckets may add from the model's measured costs."""
    try:
        measured = measure_merge_tokens(worker.runner, model, worker.batcher.boundaries[0])
    except Exception:  # only a tuning: serve with the default, the error will show again
        log.exception("batching.merge_tokens_failed")
        return
    if measured is not None:
        worker.set_merge_tokens(measured)
    log.info("batching.merge_tokens", merge_tokens=worker.batcher.merge_tokens,
             measured=measured is not None)


def run_calibration(settings: Settings, repeats: int) -> int:
    """`python -m worker calibrate`: measure each bucket, write the file `run` will load."""
    model, device = load_model(settings)
    boundaries = settings.bucket_boundaries
    if boundaries is None:
        boundaries = list(model.default_bucket_boundaries)
    try:
        buckets = calibrate(Executor(model, device),
                            memory_probe(device, settings.memory_limit_bytes), boundaries,
                            settings.max_batch_size, settings.max_batch_tokens, repeats,
                            settings.memory_high_watermark)
    except CalibrationError as exc:
        raise StartupError(str(exc)) from None
    path = calibration_path(settings.calibration_dir, settings.model_name, device)
    write_calibration(path, settings.model_name, device, buckets, repeats=repeats,
                      max_batch_size=settings.max_batch_size,
                      max_batch_tokens=settings.max_batch_tokens)
    print(f"{'max_length':>10} {'batch_size':>10} {'stopped':>13}  items/s by batch size")
    for b in buckets:
        curve = " ".join(f"{size}:{value:.0f}" for size, value in b.throughput.items())
        print(f"{b.max_length:>10} {b.batch_size:>10} {b.stopped:>13}  {curve}")
    print(f"wrote {path}")
    return 0


def exit_after_grace() -> None:
    log.warning("worker.grace_expired", hint="unanswered entries stay pending for others")
    sys.stderr.flush()
    os._exit(1)


def install_signal_handlers(worker: Worker) -> None:
    """First SIGTERM/SIGINT: stop reading, answer what is held, exit 0. Second: exit now;
    unanswered entries stay pending in the group for another worker to claim."""

    def handle(signum: int, frame: FrameType | None) -> None:
        if worker.stopping.is_set():
            log.warning("worker.forced_exit", signal=signum)
            sys.stderr.flush()
            os._exit(130)
        log.info("worker.stopping", signal=signal.Signals(signum).name,
                 grace_s=worker.settings.shutdown_grace_s)
        worker.stop()
        # A batch stuck on the device cannot be interrupted: leave its entries pending.
        watchdog = threading.Timer(worker.settings.shutdown_grace_s + GRACE_MARGIN_S,
                                   exit_after_grace)
        watchdog.daemon = True
        watchdog.start()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def serve_metrics(settings: Settings, readiness: Readiness) -> None:
    try:
        metrics.serve(settings.metrics_host, settings.metrics_port, readiness)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: {exc}") \
            from None


def freeze_heap() -> None:
    """Move what start-up made (torch, the model, the libraries: hundreds of thousands of
    objects that live as long as the process) out of the garbage collector's sight. Serving
    allocates fast, and every full collection would otherwise walk all of them."""
    gc.collect()
    gc.freeze()


def serve(settings: Settings) -> int:
    readiness = Readiness()
    serve_metrics(settings, readiness)  # first, so /healthz answers while the model loads
    with redis_url(settings) as url:
        client = connect(url, settings.block_ms)
        worker = build_worker(settings, client)
        freeze_heap()
        sampler = Sampler(worker, client).start()
        readiness.worker, readiness.redis = worker, sampler
        install_signal_handlers(worker)
        try:
            worker.run()
        finally:
            sampler.stop()
    return 1 if worker.failed else 0
