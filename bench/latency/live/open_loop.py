"""The open loop of `python -m bench.latency.live`: a producer that sends at scheduled
offsets regardless of replies, a receiver that pops replies in bulk, and the summaries of
what came back (per window, per phase, per length bucket)."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from bench.common.load import bench_reply_key
from bench.latency.sim.goals import WINDOW_S, percentile
from bench.latency.sim.simulate import Phase
from producer import protocol, request_entry


@dataclass(frozen=True)
class Sample:
    """One request of an open-loop run, timed both ways."""

    index: int
    client_ms: float  # from before the XADD call to the reply popped (the producer's view)
    xadd_ms: float  # from the XADD time (the entry id) to the reply popped: the issue's
    envelope: dict[str, Any]  # definition, up to the receiver's own lag (so never less)


class Sender:
    """The open loop's producer: XADD at the scheduled offsets, keeping each entry id. On
    schedule one XADD each; behind it, what is due in one pipeline (a round trip each would
    leave the schedule further behind, and the arrivals burstier than Poisson)."""

    def __init__(self, url: str, stream: str, payloads: Sequence[bytes],
                 offsets: Sequence[float], reply_to: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.stream, self.payloads, self.offsets, self.reply_to = (stream, payloads, offsets,
                                                                  reply_to)
        self.sent: list[tuple[float, int]] = [(0.0, 0)] * len(offsets)  # perf s, XADD ms
        self.late: list[float] = [0.0] * len(offsets)  # behind the schedule, in s

    def run(self) -> None:
        start, index, offsets = time.perf_counter(), 0, self.offsets
        while index < len(offsets):
            delay = start + offsets[index] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            before = time.perf_counter()
            due = index + 1
            while due < len(offsets) and due - index < 64 and start + offsets[due] <= before:
                due += 1
            self.send(index, due, before, before - start)
            index = due
        self.client.close()

    def send(self, index: int, due: int, before: float, elapsed: float) -> None:
        """XADD requests index..due-1 in one pipeline; keep their entry ids' times."""
        pipe = self.client.pipeline(transaction=False)
        for i in range(index, due):
            self.late[i] = elapsed - self.offsets[i]
            pipe.xadd(self.stream, request_entry.entry_fields(  # type: ignore[arg-type]
                f"p{i}", self.payloads[i % len(self.payloads)], reply_to=self.reply_to))
        for i, entry_id in zip(range(index, due), pipe.execute(), strict=True):
            self.sent[i] = (before, int(entry_id.partition(b"-")[0]))

    def lag(self) -> str:
        if not self.late:
            return "sender: nothing sent"
        worst = max(range(len(self.late)), key=self.late.__getitem__)
        p99 = sorted(self.late)[int(0.99 * len(self.late))]
        return (f"sender: worst lag {self.late[worst] * 1000:.1f} ms at "
                f"{self.offsets[worst]:.3f} s, p99 {p99 * 1000:.2f} ms")


def receive(receiver: redis.Redis, reply_to: str, expected: int,
            deadline: float) -> list[tuple[float, float, bytes]]:
    """Pop replies in bulk (BLPOP, then LPOP of what else is there) until all or deadline."""
    popped: list[tuple[float, float, bytes]] = []
    while len(popped) < expected and time.perf_counter() < deadline:
        first: Any = receiver.blpop([reply_to], timeout=1)
        if first is None:
            continue
        more: Any = receiver.lpop(reply_to, 1000) or []
        wall, perf = time.time() * 1000, time.perf_counter()
        popped += [(wall, perf, data) for data in [first[1], *more]]
    return popped


def open_loop_ids(url: str, stream: str, payloads: Sequence[bytes],
                  offsets: Sequence[float], timeout_s: float = 120.0) -> list[Sample]:
    """Send at the given offsets regardless of replies, so the receiver lags little. The
    bench process collects no garbage meanwhile: a collection once stalled the sender ~100
    ms, then it sent the lost arrivals in a burst (right at G1's step up, in every run)."""
    reply_to = bench_reply_key(stream, "bench-open-loop")  # no earlier run's replies
    receiver = redis.Redis.from_url(url)
    receiver.delete(reply_to)
    sender = Sender(url, stream, payloads, offsets, reply_to)
    thread = threading.Thread(target=sender.run, name="bench-sender", daemon=True)
    gc.disable()
    thread.start()
    deadline = time.perf_counter() + (offsets[-1] if offsets else 0.0) + timeout_s
    popped = receive(receiver, reply_to, len(offsets), deadline)
    thread.join()
    gc.enable()
    receiver.close()
    print(sender.lag(), flush=True)
    if len(popped) < len(offsets):  # the rest count as unanswered, not within T
        print(f"{len(popped)} of {len(offsets)} open-loop replies arrived", flush=True)
    samples = []
    for wall, perf, data in popped:
        envelope = protocol.decode_envelope(data)
        index = int(envelope["id"][1:])
        before, entry_ms = sender.sent[index]
        samples.append(Sample(index, (perf - before) * 1000, wall - entry_ms, envelope))
    return samples


def phase_of(at: float, bounds: Sequence[float]) -> int:
    """The phase a sending time falls in (the last one for anything after its end)."""
    return min(len(bounds) - 1, bisect_right(bounds, at))


def windowed(served: Sequence[Sample], sent_at: Sequence[float], phases: Sequence[Phase],
             target_ms: float) -> dict[str, Any]:
    """Per window of sending times, the p99 of served latencies (from the XADD time, as the
    issue defines it; `client_*` from before the XADD call); goodput per phase."""
    count = int(-(-sum(p.seconds for p in phases) // WINDOW_S))
    windows: list[list[float]] = [[] for _ in range(count)]
    client_windows: list[list[float]] = [[] for _ in range(count)]
    goodput = [0] * len(phases)
    bounds = [sum(p.seconds for p in phases[:i + 1]) for i in range(len(phases))]
    for one in served:
        at = sent_at[one.index]
        window = min(count - 1, int(at // WINDOW_S))
        windows[window].append(one.xadd_ms)
        client_windows[window].append(one.client_ms)
        goodput[phase_of(at, bounds)] += one.xadd_ms <= target_ms
    return {"windows_p99_ms": [round(percentile(w, 0.99), 1) for w in windows],
            "client_windows_p99_ms": [round(percentile(w, 0.99), 1) for w in client_windows],
            "goodput_per_phase": [round(g / p.seconds, 1) for g, p in zip(goodput, phases,
                                                                            strict=True)]}


def compute_per_phase(served: Sequence[Sample], sent_at: Sequence[float],
                      phases: Sequence[Phase]) -> list[float | None]:
    """The median batch compute time (the reply's meta) per phase: shows a drift happen."""
    bounds = [sum(p.seconds for p in phases[:i + 1]) for i in range(len(phases))]
    times: list[list[float]] = [[] for _ in phases]
    for one in served:
        computed = one.envelope.get("meta", {}).get("compute_ms")
        if computed is not None:
            times[phase_of(sent_at[one.index], bounds)].append(computed)
    return [round(statistics.median(t), 2) if t else None for t in times]


REFUSAL_BAR = 0.05  # G3: a refusal is answered within 0.05 x T of its arrival


def refusals(refused: Sequence[Sample], target_ms: float) -> dict[str, Any]:
    """How many were refused, how fast the refusals came back, and what share of them
    within G3's bar (0.05 x T)."""
    xadd = [one.xadd_ms for one in refused]
    within = sum(1 for x in xadd if x <= REFUSAL_BAR * target_ms)
    return {"refused": len(refused), "refusal_p99_ms": round(percentile(xadd, 0.99), 1),
            "refusal_max_ms": round(max(xadd, default=0.0), 1),
            "refused_within_bar": round(within / len(xadd), 5) if xadd else None,
            "client_refusal_p99_ms": round(percentile([o.client_ms for o in refused], 0.99), 1)}


def per_bucket(served: Sequence[Sample], lengths: Sequence[int],
               boundaries: Sequence[int], target_ms: float) -> dict[str, Any]:
    """Per length bucket (each request's own, as the worker's boundaries put it): how many
    were sent and served, and the served p99, so a starved bucket shows."""
    def bucket(length: int) -> str:
        return str(bisect_left(boundaries, length))

    sent: dict[str, int] = {}
    for length in lengths:
        sent[bucket(length)] = sent.get(bucket(length), 0) + 1
    latencies: dict[str, list[float]] = {b: [] for b in sent}
    for one in served:
        latencies[bucket(lengths[one.index])].append(one.xadd_ms)
    return {b: {"sent": sent[b], "served": len(v), "p99_ms": round(percentile(v, 0.99), 1),
                "within_t": sum(1 for x in v if x <= target_ms)}
            for b, v in sorted(latencies.items())}


def summarise(samples: Sequence[Sample], sent_at: Sequence[float], phases: Sequence[Phase],
              target_ms: float, lengths: Sequence[int] | None = None,
              boundaries: Sequence[int] = ()) -> dict[str, Any]:
    """Windows and goodput, p50/p99, admitted within T, refusals' speed, and with `lengths`
    (each request's) the same per length bucket."""
    served = [one for one in samples if one.envelope["ok"]]
    served_ms = [one.xadd_ms for one in served]
    row = {**windowed(served, sent_at, phases, target_ms),
           "p50_ms": round(statistics.median(served_ms), 2) if served_ms else None,
           "p99_ms": round(percentile(served_ms, 0.99), 1),
           "compute_ms_per_phase": compute_per_phase(served, sent_at, phases),
           **refusals([one for one in samples if not one.envelope["ok"]], target_ms),
           "unanswered": len(sent_at) - len(samples),
           "admitted_within_t": round(sum(1 for s in served_ms if s <= target_ms)
                                      / max(1, len(served_ms)), 4),
           "load_average": [round(v, 2) for v in os.getloadavg()]}
    if lengths is not None:
        row["buckets"] = per_bucket(served, lengths, boundaries, target_ms)
    return row
