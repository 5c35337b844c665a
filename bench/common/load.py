"""Driving load through Redis: a queued corpus drained at saturation, open-loop Poisson
arrivals, and the same Redis commands issued by a bare loop (the floor for overhead)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer import protocol
from producer.protocol import DEFAULT_GROUP
from producer.request_entry import entry_fields
from worker.streams.reader import StreamReader
from worker.streams.replier import Replier, Reply

PIPELINE_CHUNK = 1000
POLL_S = 0.002
TOP_LEVEL = ("xadd", "xreadgroup", "evalsha", "eval")  # script-internal calls are inside evalsha


@dataclass(frozen=True)
class Drained:
    seconds: float  # from the corpus appearing on the stream to the last reply
    envelopes: list[dict[str, Any]]

    @property
    def rate(self) -> float:
        return len(self.envelopes) / self.seconds


def bench_reply_key(stream: str, what: str) -> str:
    """A reply key of the stream's namespace (a worker answers only under <ns>:reply:), new
    for each run, so the run's request ids are new on it (never a duplicate_id)."""
    namespace, _, model = stream.rpartition(":requests:")
    return protocol.reply_key(namespace, f"{model}:{what}:{uuid.uuid4().hex[:12]}")


def stage(client: redis.Redis, key: str, payloads: Sequence[bytes], reply_to: str) -> float:
    """Write one entry per payload to `key` (with the workers' group); returns XADDs/s."""
    client.delete(key)
    client.xgroup_create(key, DEFAULT_GROUP, id="0", mkstream=True)
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for index, payload in enumerate(payloads):
        pipe.xadd(key, entry_fields(f"r{index}", payload,  # type: ignore[arg-type]
                                    reply_to=reply_to))
        if len(pipe) >= PIPELINE_CHUNK:
            pipe.execute()
    pipe.execute()
    return len(payloads) / (time.perf_counter() - started)


def drain(client: redis.Redis, stream: str, payloads: Sequence[bytes],
          timeout_s: float = 600.0) -> Drained:
    """Queue every payload at once and time until the last reply.

    The entries are staged under another key and RENAMEd onto the stream in one step, so
    the clock starts with the whole corpus queued and the workers already waiting on it.
    """
    reply_to = bench_reply_key(stream, "bench-replies")
    staging = f"{stream}:staging"
    client.delete(reply_to)
    stage(client, staging, payloads, reply_to)
    started = time.perf_counter()
    client.rename(staging, stream)
    deadline = started + timeout_s
    while client.llen(reply_to) < len(payloads):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{client.llen(reply_to)} of {len(payloads)} replies "
                               f"after {timeout_s} s on {stream}")
        time.sleep(POLL_S)
    seconds = time.perf_counter() - started
    replies: list[bytes] = client.lrange(reply_to, 0, -1)  # type: ignore[assignment]
    client.delete(reply_to)
    return Drained(seconds, [protocol.decode_envelope(data) for data in replies])


@dataclass(frozen=True)
class Timed:
    """One request of an open-loop run: end-to-end seconds and its reply."""

    latency_s: float
    envelope: dict[str, Any]


def poisson_offsets(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process."""
    rng = random.Random(seed)
    offsets: list[float] = []
    now = rng.expovariate(rate)
    while now < duration_s:
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def open_loop(url: str, stream: str, payloads: Sequence[bytes], rate: float,
              duration_s: float, seed: int = 0, timeout_s: float = 120.0) -> list[Timed]:
    """Send at Poisson times regardless of replies (open loop); time each request's reply."""
    return open_loop_at(url, stream, payloads, poisson_offsets(rate, duration_s, seed),
                        timeout_s)


def open_loop_at(url: str, stream: str, payloads: Sequence[bytes], offsets: Sequence[float],
                 timeout_s: float = 120.0) -> list[Timed]:
    """Send at the given offsets (seconds from now) regardless of replies; time each reply."""
    duration_s = offsets[-1] if offsets else 0.0
    reply_to = bench_reply_key(stream, "bench-open-loop")
    sent: dict[str, float] = {}
    timed: list[Timed] = []
    sender_client, receiver = redis.Redis.from_url(url), redis.Redis.from_url(url)
    receiver.delete(reply_to)

    def send() -> None:
        start = time.perf_counter()
        for index, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            request_id = f"p{index}"
            sent[request_id] = time.perf_counter()
            sender_client.xadd(stream, entry_fields(  # type: ignore[arg-type]
                request_id, payloads[index % len(payloads)], reply_to=reply_to))

    sender = threading.Thread(target=send, name="bench-sender", daemon=True)
    sender.start()
    deadline = time.perf_counter() + duration_s + timeout_s
    while len(timed) < len(offsets) and time.perf_counter() < deadline:
        popped: Any = receiver.blpop([reply_to], timeout=1)
        if popped is None:
            continue
        received = time.perf_counter()
        envelope = protocol.decode_envelope(popped[1])
        timed.append(Timed(received - sent[envelope["id"]], envelope))
    sender.join()
    sender_client.close()
    receiver.close()
    if len(timed) < len(offsets):
        raise TimeoutError(f"{len(timed)} of {len(offsets)} open-loop replies arrived")
    return timed


@dataclass(frozen=True)
class Floor:
    """What Redis sustains for a worker's commands when nothing else is done."""

    xadd_rate: float  # requests/s staged by pipelined XADD
    serve_rate: float  # requests/s through XREADGROUP + the reply-and-ack script
    server_us_per_request: float  # Redis CPU per request (INFO commandstats), all commands


def redis_floor(client: redis.Redis, stream: str, payloads: Sequence[bytes], reply: bytes,
                read_count: int, ttl_ms: int = 3_600_000) -> Floor:
    """The same commands per request as a worker — XADD, XREADGROUP, LPUSH + PEXPIRE + XACK in
    the worker's own Lua script — from a bare loop using the worker's own reader and replier."""
    reply_to = bench_reply_key(stream, "bench-floor")
    client.delete(reply_to, stream)
    client.config_resetstat()
    xadd_rate = stage(client, stream, payloads, reply_to)
    reader = StreamReader(client, stream, DEFAULT_GROUP, "bench-floor")
    reader.draining_own_pending = False
    replier = Replier(client, stream, DEFAULT_GROUP, "bench-floor", ttl_ms,
                      answered_key=f"{stream}:answered")
    answered = 0
    started = time.perf_counter()
    while answered < len(payloads):
        entries = reader.read(read_count, 1000)
        replier.send([Reply(entry.id, reply_to, reply) for entry in entries])
        answered += len(entries)
    serve_rate = answered / (time.perf_counter() - started)
    stats = client.info("commandstats")
    server_us = sum(stats.get(f"cmdstat_{name}", {}).get("usec", 0) for name in TOP_LEVEL)
    client.delete(reply_to, stream, f"{stream}:answered")
    return Floor(xadd_rate, serve_rate, server_us / len(payloads))
