"""`python -m worker run`: serve one worker process until a signal.

The worker comes from the composition root (app.build_worker); this module owns what a
process needs around it: the metrics endpoint, the heap freeze, the sampler and signals
(worker/commands/shutdown.py).
"""

from __future__ import annotations

import errno
import gc

from worker.app import StartupError, build_worker, connect
from worker.commands.readiness import Readiness
from worker.commands.sampler import Sampler
from worker.commands.shutdown import Shutdown
from worker.observe import metrics
from worker.observe.progress import ProgressLog
from worker.settings import Settings
from worker.streams.target import redis_url


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
        shutdown = Shutdown(worker.stop, settings.shutdown_grace_s).install()
        try:
            worker.run()
        finally:
            progress.stop()
            sampler.stop()
    shutdown.code = 1 if worker.failed else 0  # what the deadline exits with from here on
    return shutdown.code
