"""The batch CLI's engine: a sliding window of requests in flight on one shared reply key,
results handed on in input order as they arrive.

At most `window` requests are submitted and not yet handed on (so memory stays bounded
whatever the input's size); a request with no reply `timeout` seconds after it was sent is
handed on as a `timeout` error envelope. With a `max_backlog`, a refused submit waits and
tries again (smaller) until `backlog_wait_s` passes, then BacklogFull.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from producer import protocol
from producer.client import Client
from producer.errors import Overloaded
from producer.request_base import new_request_id

RECEIVE_S = 0.05  # each BLPOP of a window round blocks at most this long
BACKLOG_RETRY_S = 0.2


class BacklogFull(Exception):
    """The group's backlog stayed at max_backlog for the whole wait."""


@dataclass
class Item:
    request_id: str
    payload: Any
    tag: dict[str, Any] = field(default_factory=dict)  # added to the output record
    deadline: float = 0.0


@dataclass
class RunSummary:
    count: int = 0
    failed: int = 0
    seconds: float = 0.0
    envelopes: list[dict[str, Any]] = field(default_factory=list)  # kept by run_requests

    @property
    def throughput(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        return (f"{self.count} requests, {self.failed} failed, "
                f"{self.seconds:.2f} s, {self.throughput:.1f} requests/s")


class Window:
    """One run: submit while under `window`, receive, hand on the head while answered."""

    def __init__(self, client: Client, window: int, timeout: float,
                 backlog_wait_s: float) -> None:
        self.client, self.window, self.timeout = client, window, timeout
        self.backlog_wait_s = backlog_wait_s
        self.reply_to = client.new_reply_key()
        self.pending: deque[Item] = deque()
        self.ids: set[str] = set()
        self.answered: dict[str, dict[str, Any]] = {}
        self.most_in_flight = 0

    def run(self, items: Iterable[Item], emit: Callable[[dict[str, Any]], None]) -> None:
        """Until every item is handed on to `emit`, in order."""
        source = iter(items)
        try:
            while True:
                self._submit(list(islice(source, self.window - len(self.pending))))
                if not self.pending:
                    return
                self._receive()
                for envelope in self._ready():
                    emit(envelope)
        finally:
            self.client.redis.delete(self.reply_to)

    def _submit(self, batch: list[Item]) -> None:
        """Submit `batch`, retrying the refused part while the backlog is full."""
        deadline, size = time.monotonic() + self.backlog_wait_s, max(1, len(batch))
        while batch:
            part = batch[:size]
            try:
                self._send(part)
                batch = batch[len(part):]
            except Overloaded as exc:
                batch = batch[len(exc.submitted):]
                size = max(1, (len(part) - len(exc.submitted)) // 2)
                if time.monotonic() >= deadline:
                    raise BacklogFull(f"{exc}; still full after {self.backlog_wait_s:g} s "
                                      f"of waiting (--backlog-wait)") from None
                time.sleep(BACKLOG_RETRY_S)

    def _send(self, part: list[Item]) -> None:
        try:
            self.client.submit_many([i.payload for i in part], reply_to=self.reply_to,
                                    request_ids=[i.request_id for i in part])
        except Overloaded as exc:
            self._track(part[:len(exc.submitted)])
            raise
        self._track(part)

    def _track(self, sent: list[Item]) -> None:
        deadline = time.monotonic() + self.timeout
        for item in sent:
            item.deadline = deadline
            self.pending.append(item)
            self.ids.add(item.request_id)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))

    def _receive(self) -> None:
        wanted = len(self.pending) - len(self.answered)
        for envelope in self.client.collect(self.reply_to, wanted, RECEIVE_S, ids=self.ids):
            self.answered[envelope["id"]] = envelope

    def _ready(self) -> Iterator[dict[str, Any]]:
        """The head's envelopes that are answered, or past their deadline."""
        now = time.monotonic()
        while self.pending:
            head = self.pending[0]
            envelope = self.answered.pop(head.request_id, None)
            if envelope is None and head.deadline > now:
                return
            self.pending.popleft()
            self.ids.discard(head.request_id)
            yield {**(envelope or protocol.error_envelope(
                head.request_id, "timeout", f"no reply within {self.timeout} s")), **head.tag}


def run_requests(client: Client, payloads: list[Any], timeout: float,
                 progress: bool = False, window: int = 1000) -> RunSummary:
    """Every payload through a window, the envelopes kept in input order (for the demo)."""
    summary, started = RunSummary(), time.perf_counter()
    items = (Item(new_request_id(), payload) for payload in payloads)
    Window(client, window, timeout, timeout).run(items, summary.envelopes.append)
    summary.count = len(summary.envelopes)
    summary.failed = sum(1 for e in summary.envelopes if not e["ok"])
    summary.seconds = time.perf_counter() - started
    return summary
