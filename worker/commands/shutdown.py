"""SIGTERM/SIGINT for `python -m worker run`, handled off the main thread, with a deadline.

The first signal stops reading and answers what is held until `shutdown_grace_s`; at
grace + `GRACE_MARGIN_S` the process exits whatever it is doing, leaving its unanswered
entries pending for another worker to claim (exactly once: the reclaim's own guard). A
second signal exits at once.

Why not a Python signal handler that does the work: it runs in the main thread between two
bytecodes, which is late (after the forward the main thread's compute loop is in) and unsafe
(the main thread may hold the worker's one lock, or structlog's write lock, which the handler
then takes again: a deadlock that left a worker running long past its grace, issue 45). Here
the interpreter's C-level handler writes the signal's number to a pipe
(`signal.set_wakeup_fd`) at once, in whichever thread the signal lands, and a thread of
our own reads it and acts; the Python-level handler does nothing.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

import structlog

log = structlog.get_logger("redbatch")
GRACE_MARGIN_S = 1.5  # beyond shutdown_grace_s: the exit comes within grace + 2 s
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def write_line(event: str, **fields: object) -> None:
    """A JSON log line by one write(2): no lock that a stuck thread could hold."""
    line = json.dumps({"event": event, "level": "warning", **fields}) + "\n"
    os.write(2, line.encode())


def ignore(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the wakeup pipe has carried the signal already."""


class Shutdown:
    """Listens for the stop signals; `stop` is called once, from the listening thread.

    `code` is the exit status at the deadline: 1 (entries left pending) until the worker
    has stopped and answered what it held, then the worker's own (the interpreter's exit
    may outlast the deadline under load; its status stays what the worker reached)."""

    def __init__(self, stop: Callable[[], None], grace_s: float) -> None:
        self.stop, self.grace_s = stop, grace_s
        self.code = 1
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.thread = threading.Thread(target=self.listen, name="redbatch-signals",
                                       daemon=True)

    def install(self) -> Shutdown:
        """Call from the main thread (set_wakeup_fd must be), once the worker is built."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, ignore)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread.start()
        return self

    def next_signal(self) -> int:
        """Block until a stop signal arrives; its number."""
        while True:
            for signum in os.read(self.read_fd, 64):
                if signum in STOP_SIGNALS:
                    return signum

    def listen(self) -> None:
        first = self.next_signal()
        deadline = threading.Timer(self.grace_s + GRACE_MARGIN_S, self.expire)
        deadline.daemon = True
        deadline.start()  # first: nothing below may delay it
        log.info("worker.stopping", signal=signal.Signals(first).name, grace_s=self.grace_s)
        self.stop()
        second = self.next_signal()
        write_line("worker.forced_exit", signal=second)
        os._exit(128 + second)  # the shell's convention: 143 for SIGTERM, 130 for SIGINT

    def expire(self) -> None:
        """A batch stuck on the device, a blocking read, a slow interpreter exit: go now."""
        if self.code:
            write_line("worker.grace_expired", hint="unanswered entries stay pending for others")
        os._exit(self.code)
