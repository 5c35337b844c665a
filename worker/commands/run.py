"""`python -m worker run`: serve one worker process until a signal.

The worker comes from the composition root (app.build_worker); this module owns what a
process needs around it: the metrics endpoint, the heap freeze, the sampler and signals.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import threading
from types import FrameType

import structlog

from worker.app import StartupError, build_worker, connect
from worker.commands.readiness import Readiness
from worker.commands.sampler import Sampler
from worker.observe import metrics
from worker.observe.progress import ProgressLog
from worker.pipeline.worker import Worker
from worker.settings import Settings
from worker.streams.target import redis_url

log = structlog.get_logger("redbatch")
GRACE_MARGIN_S = 2.0  # beyond shutdown_grace_s, for the last blocking read to return


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
            os._exit(128 + signum)  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
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


def port_hint(exc: OSError) -> str:
    """What to do when the metrics port is taken (the CLI adds where the port was set)."""
    return (" (another worker on this host?): give each its own --metrics-port, or "
            "--metrics-port 0 to disable /metrics") if exc.errno == errno.EADDRINUSE else ""


def serve_metrics(settings: Settings, readiness: Readiness) -> None:
    try:
        metrics.serve(settings.metrics_host, settings.metrics_port, readiness)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: "
                           f"{exc.strerror or exc}{port_hint(exc)}", ("metrics_port",)) from None


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
        client = connect(url, settings.block_ms, cluster=settings.redis_cluster,
                         password=settings.redis_secret)
        worker = build_worker(settings, client)
        freeze_heap()
        sampler = Sampler(worker, client).start()
        progress = ProgressLog(worker.name, settings.log_interval_s).start()
        readiness.worker, readiness.redis = worker, sampler
        install_signal_handlers(worker)
        try:
            worker.run()
        finally:
            progress.stop()
            sampler.stop()
    return 1 if worker.failed else 0
