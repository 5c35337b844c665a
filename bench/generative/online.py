"""The generative workload through Redis and a real worker process, as a producer sends it.

- `closed_loop`: `concurrency` requests in flight; each reply sends the next. Generated
  tokens per second of wall time, counted from the replies (`result.tokens`).
- `ttft`: time to first token from each reply's `meta.ttft_ms`, which the worker measures
  from the XADD time (the entry id) to the step that sampled the first token: queueing
  included. Unloaded is one request at a time; loaded is open-loop Poisson arrivals.
- `RssPeak`: the worker's resident memory, sampled from /proc while it serves.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import redis

from bench.common.load import open_loop_at, poisson_offsets
from bench.generative.offline import Run
from bench.generative.workload import GenRequest
from producer import protocol, request_entry


def _reply_key() -> str:
    """A reply key per run: its ids (g<index>) are new on it, never a duplicate_id."""
    return f"redbatch:reply:bench-generative:{uuid.uuid4().hex[:12]}"


def _send(client: redis.Redis, stream: str, index: int, request: GenRequest,
          reply_key: str) -> None:
    client.xadd(stream, request_entry.entry_fields(  # type: ignore[arg-type]
        f"g{index}", msgpack.packb(request.payload), reply_to=reply_key))


def _result(raw: bytes | dict[str, Any]) -> dict[str, Any]:
    envelope = raw if isinstance(raw, dict) else protocol.decode_envelope(raw)
    if not envelope.get("ok"):
        raise RuntimeError(f"a generation failed: {envelope.get('error')}")
    return envelope


def _pop(client: redis.Redis, timeout_s: float, reply_key: str) -> dict[str, Any]:
    """The next reply, polling in 1 s BLPOPs (redis-py's default socket timeout is 5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        popped: Any = client.blpop([reply_key], timeout=1)
        if popped is not None:
            return _result(popped[1])
    raise TimeoutError(f"no generation came back within {timeout_s:.0f} s")


def closed_loop(url: str, stream: str, requests: Sequence[GenRequest], concurrency: int,
                timeout_s: float = 600.0) -> Run:
    """Keep `concurrency` requests in flight until every one is answered."""
    client, reply_key = redis.Redis.from_url(url), _reply_key()
    started = time.perf_counter()
    sent = min(concurrency, len(requests))
    for index in range(sent):
        _send(client, stream, index, requests[index], reply_key)
    outputs: dict[int, list[int]] = {}
    tokens = 0
    while len(outputs) < len(requests):
        envelope = _pop(client, timeout_s, reply_key)
        outputs[int(envelope["id"][1:])] = []
        tokens += int(envelope["result"]["tokens"])
        if sent < len(requests):
            _send(client, stream, sent, requests[sent], reply_key)
            sent += 1
    seconds = time.perf_counter() - started
    client.close()
    return Run(seconds, tokens, outputs)


def ttft_unloaded(url: str, stream: str, requests: Sequence[GenRequest]) -> list[float]:
    """TTFT (ms) of each request sent alone, one after another."""
    client, reply_key = redis.Redis.from_url(url), _reply_key()
    values = []
    for index, request in enumerate(requests):
        _send(client, stream, index, request, reply_key)
        values.append(float(_pop(client, 600, reply_key)["meta"]["ttft_ms"]))
    client.close()
    return values


def ttft_loaded(url: str, stream: str, requests: Sequence[GenRequest], rate: float,
                seed: int = 0) -> list[float]:
    """TTFT (ms) under open-loop Poisson arrivals at `rate` requests/s, in request order."""
    offsets = poisson_offsets(rate, 2 * len(requests) / rate + 10, seed)[:len(requests)]
    payloads = [msgpack.packb(r.payload) for r in requests]
    timed = open_loop_at(url, stream, payloads, offsets, timeout_s=600.0)
    by_index = {int(item.envelope["id"][1:]): float(_result(item.envelope)["meta"]["ttft_ms"])
                for item in timed}  # ids are p<index>
    return [by_index[index] for index in range(len(requests))]


class RssPeak:
    """The highest VmRSS of a process, sampled every `interval_s` while the block runs."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.status = Path(f"/proc/{pid}/status")
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.start_bytes = 0  # when the block began: the model loaded, before serving
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="rss")

    def field_bytes(self, name: str) -> int:
        for line in self.status.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.field_bytes("VmRSS"))

    def __enter__(self) -> RssPeak:
        self.peak_bytes = self.start_bytes = self.field_bytes("VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
