"""Per-stage CPU time of a running worker: per-thread CPU clocks around each stage's function.

`StageClock(model)` patches the worker's stage functions (and the model's methods) for the
duration of a `with` block; a call inside another measured call counts for the outer one
only, so no time is counted twice. `process` is the process's CPU time over the block less
the CPU time of the thread that opened it (the benchmark's producer). `native` is the CPU
time of the process's threads that Python did not start (Linux, from /proc): the Rust
tokenizer's pool, where a batch tokeniser does its work while its caller waits, so
`tokenise` alone (the caller's CPU) leaves most of tokenising out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.models.base import Model

STAGES = ("read", "decode", "tokenise", "batch", "collate", "forward", "postprocess",
          "envelope", "encode", "reply")


def _targets(model: Model) -> list[tuple[Any, str, str]]:
    """(owner, attribute, stage) of every function measured."""
    import producer.protocol
    import producer.request_entry
    import worker.pipeline.compute
    import worker.pipeline.reply
    from worker.policy.batching import Batcher
    from worker.streams.reader import StreamReader
    from worker.streams.replier import Replier

    tokenise = "prepare_many" if hasattr(model, "prepare_many") else "prepare"
    return [(StreamReader, "read", "read"), (producer.request_entry, "parse_entry", "decode"),
            (producer.protocol, "decode", "decode"), (model, tokenise, "tokenise"),
            (Batcher, "add", "batch"), (Batcher, "next_batch", "batch"),
            (model, "collate", "collate"), (model, "forward", "forward"),
            (model, "postprocess", "postprocess"),
            (worker.pipeline.compute, "result_answers", "envelope"),
            (worker.pipeline.reply, "encode", "encode"), (Replier, "send", "reply")]


class StageClock:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.ns: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def _wrap(self, function: Callable[..., Any], stage: str) -> Callable[..., Any]:
        def measured(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return function(*args, **kwargs)
            self._inside.active = True
            started = time.thread_time_ns()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - started
                self._inside.active = False
                with self._lock:
                    self.ns[stage] += spent

        return measured

    def __enter__(self) -> StageClock:
        for owner, name, stage in _targets(self.model):
            own = name in vars(owner) if not isinstance(owner, Model) else False
            original = getattr(owner, name)
            self._saved.append((owner, name, vars(owner).get(name) if own else None, own))
            setattr(owner, name, self._wrap(original, stage))
        self._process = time.process_time_ns()
        self._thread = time.thread_time_ns()
        self._native = native_threads_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        thread = time.thread_time_ns() - self._thread
        self.process_ns = time.process_time_ns() - self._process - thread
        # threads that ended meanwhile are missed; the native pool lives as long as the process
        self.native_ns = sum(ns - self._native.get(tid, 0)
                             for tid, ns in native_threads_ns().items())
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the model's bound method shows through again
        self._saved.clear()

    def per_request_us(self, requests: int) -> dict[str, float]:
        costs = {stage: ns / 1000 / requests for stage, ns in self.ns.items()}
        costs["sum"] = sum(costs.values())
        costs["native"] = self.native_ns / 1000 / requests
        costs["process"] = self.process_ns / 1000 / requests
        return costs


def native_threads_ns() -> dict[int, int]:
    """CPU ns of each of this process's threads that Python did not start (none where
    /proc cannot be read)."""
    python = {thread.native_id for thread in threading.enumerate()}
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    found: dict[int, int] = {}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return found
    for tid in set(tids) - python:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:  # it ended
            continue
        found[tid] = (int(fields[11]) + int(fields[12])) * tick_ns  # utime + stime
    return found
