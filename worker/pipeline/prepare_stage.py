"""The prepare stage: a read's decoding, tokenising and queueing, off the reader thread.

The intake's reader thread reads, parses and claims ids; it hands each read's requests to
this stage, whose thread (`redbatch-prepare`) decodes them, runs the model's
`prepare_many` (a batch tokeniser: the Rust tokenizer works outside the GIL, on every
core) and queues them for the compute loops. So the next XREADGROUP and its parsing
overlap this read's tokenising, where one thread did both in turn (TEI's tokenization
workers, for the same reason). One thread keeps the reads' order and calls the model's
`prepare_many` from one thread only, as before; a read's entries are held (in flight)
from the moment they are handed over, so flow control and redeliveries count them. The
worker runs it threaded on an accelerator only (worker.prepares_on_a_thread); unthreaded,
each hand-over runs at once on the reader thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

DEPTH = 2  # reads handed over and not yet queued: one tokenising, one waiting behind it


class PrepareStage:
    def __init__(self, threaded: bool = True, depth: int = DEPTH) -> None:
        """`threaded`: False runs each hand-over at once, on the caller's thread."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="redbatch-prepare") \
            if threaded else None
        self._depth = depth
        self._pending: deque[Future[None]] = deque()

    def submit(self, work: Callable[..., None], *args: Any) -> None:
        """Run `work(*args)` on the stage's thread, in order. Blocks while `depth` reads
        are still unqueued (backpressure); an exception of earlier work is raised here."""
        if self._pool is None:
            work(*args)
            return
        self._reap(keep=self._depth - 1)
        self._pending.append(self._pool.submit(work, *args))

    def drain(self) -> None:
        """Wait until everything handed over is queued (or answered); then stop the thread.
        The first exception of the work is raised here."""
        try:
            self._reap(keep=0)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _reap(self, keep: int) -> None:
        """Collect finished work, and wait until at most `keep` are left unfinished."""
        while self._pending and (self._pending[0].done() or len(self._pending) > keep):
            self._pending.popleft().result()  # re-raises the work's exception
