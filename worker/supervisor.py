"""`--processes N` / `--devices cuda:0,cuda:1`: run and supervise worker processes.

Each child is a plain `python -m worker run` with every setting passed as a flag, its own
consumer name and device. Slot i keeps the name `<consumer>-i` across restarts, so a child
that replaces a crashed one drains its predecessor's pending entries at once instead of
waiting `claim_idle_ms` for a reclaim. Children run in their own session: a terminal's
Ctrl-C reaches the supervisor only, which passes SIGTERM/SIGINT on and waits for them.
Their metrics are collected in a multiprocess directory and served here, summed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

import structlog
from prometheus_client import CollectorRegistry, multiprocess

from worker.app import StartupError
from worker.commands.run import port_hint
from worker.execution.cores import available_cores
from worker.observe.endpoints import start_server
from worker.policy.backoff import backoff_delays
from worker.policy.layout import share_cores
from worker.setting_sources import SECRET_SETTINGS
from worker.settings import Settings, exported
from worker.streams.target import redis_url

log = structlog.get_logger("redbatch.supervisor")
HEALTHY_AFTER_S = 60.0  # a child that lived this long restarts without backoff
EXIT_STARTUP_ERROR = 2  # the child's exit code for bad settings: restarting will not help
POLL_S = 0.2


def child_settings(settings: Settings, url: str) -> list[Settings]:
    """One Settings per child: its slot's consumer name and device, one process, no /metrics,
    and its share of the cores (each child lays out its instances on them)."""
    devices = [d.strip() for d in settings.devices.split(",") if d.strip()]
    slots = devices or [settings.device] * settings.processes
    cores = share_cores(settings.cpu_cores or available_cores(), len(slots))
    return [settings.model_copy(update={
        "consumer": f"{settings.consumer}-{slot}", "device": device, "redis_url": url,
        "processes": 1, "devices": "", "metrics_port": 0, "cpu_cores": cores})
        for slot, device in enumerate(slots)]


def settings_flags(settings: Settings) -> list[str]:
    """Command-line flags that reproduce these settings exactly in a child process, but for
    the secrets (secret_environment)."""
    flags: list[str] = []
    for name, text in exported(settings).items():
        if name not in SECRET_SETTINGS:
            flags += [f"--{name.replace('_', '-')}", text]
    return flags


def secret_environment(settings: Settings) -> dict[str, str]:
    """The secret settings as REDBATCH_* variables: `ps` shows a command line to anyone."""
    return {f"REDBATCH_{name.upper()}": text for name, text in exported(settings).items()
            if name in SECRET_SETTINGS}


@dataclass
class Child:
    slot: int
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    delays: Iterator[float] = field(default_factory=lambda: backoff_delays(0.5, 10.0))


class Supervisor:
    def __init__(self, commands: list[list[str]], env: dict[str, str]) -> None:
        self.children = [Child(slot, command) for slot, command in enumerate(commands)]
        self.env = env
        self.stopping = threading.Event()
        self.exit_code = 0
        self.received: deque[int] = deque()  # signals not yet passed on

    def receive(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: it only records. A handler runs in the main thread between
        two bytecodes, maybe inside a log write or the stop event's lock, which logging or
        setting the event here would take again: a deadlock (issue 45)."""
        self.received.append(signum)

    def run(self) -> int:
        """Keep every child running until a signal; then pass it on and wait for them."""
        for child in self.children:
            self._start(child)
        while not self.stopping.wait(POLL_S):
            self._pass_on()
            for child in self.children:
                self._tend(child)
        for child in self.children:  # a second signal still reaches them meanwhile
            while child.process and child.process.poll() is None:
                self._pass_on()
                time.sleep(POLL_S)
        log.info("supervisor.stopped", exit_code=self.exit_code)
        return self.exit_code

    def _pass_on(self) -> None:
        while self.received:
            signum = self.received.popleft()
            log.info("supervisor.signal", signal=signal.Signals(signum).name)
            self.signal(signum)

    def readiness(self) -> dict[str, bool]:
        """For /readyz: every child is running and no shutdown has begun."""
        running = all(c.process is not None and c.process.poll() is None for c in self.children)
        return {"children": running and not self.stopping.is_set()}

    def signal(self, signum: int) -> None:
        """Pass a signal on to every child (a second one makes them exit at once)."""
        self.stopping.set()
        for child in self.children:
            if child.process and child.process.poll() is None:
                child.process.send_signal(signum)

    def _start(self, child: Child) -> None:
        child.process = subprocess.Popen(child.command, env=self.env, start_new_session=True)
        child.started_at = time.monotonic()
        log.info("child.started", slot=child.slot, pid=child.process.pid)

    def _tend(self, child: Child) -> None:
        """Restart a child that died, after a backoff that grows while it keeps dying."""
        assert child.process is not None
        code = child.process.poll()
        now = time.monotonic()
        if code is None or self.stopping.is_set():
            return
        if not child.restart_at:  # just noticed
            multiprocess.mark_process_dead(child.process.pid,
                                           self.env["PROMETHEUS_MULTIPROC_DIR"])
            if code == EXIT_STARTUP_ERROR:
                log.error("child.cannot_start", slot=child.slot)
                self.exit_code = EXIT_STARTUP_ERROR
                self.signal(signal.SIGTERM)
                return
            if now - child.started_at > HEALTHY_AFTER_S:
                child.delays = backoff_delays(0.5, 10.0)
            delay = next(child.delays)
            child.restart_at = now + delay
            log.warning("child.died", slot=child.slot, pid=child.process.pid, exit_code=code,
                        restart_in_s=round(delay, 2))
        elif now >= child.restart_at:
            child.restart_at = 0.0
            self._start(child)


def serve_metrics(directory: str, host: str, port: int, supervisor: Supervisor) -> None:
    """/metrics summing every child's samples (prometheus_client multiprocess mode), beside
    /healthz and /readyz."""
    if port:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        start_server(host, port, registry, supervisor.readiness)


def supervise(settings: Settings) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="redbatch-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    try:
        with redis_url(settings) as url:
            children = child_settings(settings, url)
            commands = [[sys.executable, "-m", "worker", "run", *settings_flags(child)]
                        for child in children]
            supervisor = Supervisor(commands, {**env, **secret_environment(children[0]),
                                               **settings.sources.environment_for_children()})
            try:
                serve_metrics(metrics_dir, settings.metrics_host, settings.metrics_port,
                              supervisor)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: "
                                   f"{exc.strerror or exc}{port_hint(exc)}",
                                   ("metrics_port",)) from None
            signal.signal(signal.SIGTERM, supervisor.receive)
            signal.signal(signal.SIGINT, supervisor.receive)
            log.info("supervisor.started", processes=len(commands), metrics_dir=metrics_dir)
            return supervisor.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
