"""Redis Cluster: one logical queue read as N shard streams (shard_stream_key).

The pipeline above stays as it is: it sees entries whose ids carry their shard
(`<ms>-<seq>@<shard>`, so ids of two streams never collide and `entry_time_ms` still reads
the XADD time) and whose default reply key is the shard's (`<ns>:reply:{<m>:<s>}:<id>`, set
here when the producer named none). The sharded parts split ids by shard again and run each
shard's scripts with that shard's keys only, all in its slot.

Reading: one thread per shard, each one blocking XREADGROUP on its shard (redis-py routes it
to the shard's master, and follows MOVED), all feeding the one intake. The intake's `read`
hands out budgets (COUNT) so that what the threads hold and read never passes the room it
asked for, and returns as soon as any shard has entries; the others go on blocking and
their entries come with a later read. Errors of a shard's read are raised in the intake's
thread when no other shard has entries, where RedisRetry backs off; the thread backs off.

Own pending entries: at start, each shard's are drained one at a time (StreamReader's rule:
one of them may be the poison that crashed the last process). After a fault (a read whose
reply was lost may have delivered entries to us), the shard's pending entries are read again
from the start, with a cursor and in full reads, while the other shards go on: the intake
skips those it holds. A shard whose master is down does not hold the others up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import redis

from producer import connection
from producer.shards import shard_reply_key
from worker.policy.backoff import backoff_delays
from worker.streams.reader import Entry, StreamReader

JOIN_MARGIN_S = 2.0  # on close, a thread's blocked read ends within block_ms + this
RECOVER_RETRY_S = 1.0


def tagged(entry_id: str, shard: int) -> str:
    return f"{entry_id}@{shard}"


def untagged(entry_id: str) -> tuple[str, int]:
    """(the stream's own id, the shard) of a tagged id."""
    raw, _, shard = entry_id.rpartition("@")
    return raw, int(shard)


def by_shard(entry_ids: Sequence[str]) -> dict[int, list[str]]:
    """Tagged ids grouped by shard, as the stream's own ids."""
    groups: dict[int, list[str]] = {}
    for entry_id in entry_ids:
        raw, shard = untagged(entry_id)
        groups.setdefault(shard, []).append(raw)
    return groups


class Localiser:
    """Entries of one shard as the pipeline sees them (see the module's docstring)."""

    def __init__(self, namespace: str, model: str) -> None:
        self.namespace, self.model = namespace, model

    def __call__(self, entries: Sequence[Entry], shard: int) -> list[Entry]:
        for entry in entries:
            entry.id = tagged(entry.id, shard)
            fields = entry.fields
            if fields is not None and fields.get(b"id"):
                prefix = shard_reply_key(self.namespace, self.model, shard, "")
                default = prefix.encode() + fields[b"id"]
                entry.default_reply = default.decode(errors="replace")
                fields.setdefault(b"reply_to", default)
        return list(entries)

    def original(self, entry: Entry) -> Entry:
        """The entry with its stream's own id (for a shard's scripts)."""
        return Entry(untagged(entry.id)[0], entry.fields, entry.redelivered,
                     entry.default_reply)


Result = list[Entry] | Exception


class ShardedReader:
    """Reads every shard of the model: own pending entries first, then new ones."""

    def __init__(self, readers: Sequence[StreamReader], localise: Localiser) -> None:
        self.readers = list(readers)
        self.localise = localise
        self.stream = f"{readers[0].stream} (+{len(readers) - 1} shards)"
        self.group, self.consumer = readers[0].group, readers[0].consumer
        self._cond = threading.Condition()
        self._grants = [0] * len(readers)  # COUNT of each shard's next or running read
        self._results: deque[Result] = deque()
        self._queued = 0  # entries read by the threads, not yet handed out
        self._threads: list[threading.Thread] = []
        self._block_ms = 1000
        self._first = 0  # the shard first in line for a budget, rotated
        self._closed = False
        self._recover: dict[int, str] = {}  # after a fault: shard -> read own pending after
        self._recover_at: dict[int, float] = {}  # a shard whose recovery read failed: when again

    @property
    def draining_own_pending(self) -> bool:
        """The start-up drain, one entry at a time (the intake then waits for room 1)."""
        return any(r.draining_own_pending for r in self.readers)

    @draining_own_pending.setter
    def draining_own_pending(self, value: bool) -> None:
        """Set after a fault: read every shard's own pending entries again (cursor reads)."""
        if value:
            with self._cond:
                self._recover = dict.fromkeys(range(len(self.readers)), "0")

    def ensure_group(self) -> None:
        for reader in self.readers:
            reader.ensure_group()

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Up to about `count` entries: own pending ones (one at a time), else new ones
        from whichever shards have some, waiting at most `block_ms`."""
        for shard, reader in enumerate(self.readers):
            if reader.draining_own_pending:
                entries = reader.read_own_pending()
                if entries:
                    return self.localise(entries, shard)
        recovered = self._recovered(count)
        if recovered:
            return recovered
        self._start(block_ms)
        deadline = time.monotonic() + block_ms / 1000
        with self._cond:
            while not self._results and not self._closed:
                self._grant(count)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._take()

    def _recovered(self, count: int) -> list[Entry]:
        """Own pending entries of a shard after a fault, `count` at a time past a cursor;
        a shard whose read fails is tried again a second later, the others go on."""
        with self._cond:
            due = [(s, after) for s, after in self._recover.items()
                   if self._recover_at.get(s, 0.0) <= time.monotonic()]
        for shard, after in due:
            try:
                entries = self.readers[shard].read_pending_after(after, count)
            except redis.RedisError as exc:
                connection.follow_cluster(self.readers[shard].client, exc)
                self._recover_at[shard] = time.monotonic() + RECOVER_RETRY_S
                continue
            with self._cond:
                if entries:
                    self._recover[shard] = entries[-1].id
                else:
                    self._recover.pop(shard, None)
            if entries:
                return self.localise(entries, shard)
        return []

    def close(self) -> list[Entry]:
        """Stop the threads; the entries they read meanwhile, for the intake to admit."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(self._block_ms / 1000 + JOIN_MARGIN_S)
        with self._cond:
            entries = [e for r in self._results if isinstance(r, list) for e in r]
            self._results.clear()
            return entries

    def _start(self, block_ms: int) -> None:
        if self._threads:
            return
        self._block_ms = block_ms
        self._threads = [threading.Thread(target=self._serve, args=(shard,), daemon=True,
                                          name=f"redbatch-reader-{shard}")
                         for shard in range(len(self.readers))]
        for thread in self._threads:
            thread.start()

    def _grant(self, count: int) -> None:
        """With the condition held: share what is left of `count` among idle shards."""
        budget = count - self._queued - sum(self._grants)
        idle = [s for s in self._rotation() if not self._grants[s]]
        if budget <= 0 or not idle:
            return
        share = max(1, budget // len(idle))
        for shard in idle:
            if budget <= 0:
                break
            self._grants[shard] = min(share, budget)
            budget -= self._grants[shard]
        self._first = (self._first + 1) % len(self.readers)
        self._cond.notify_all()

    def _rotation(self) -> list[int]:
        n = len(self.readers)
        return [(self._first + i) % n for i in range(n)]

    def _take(self) -> list[Entry]:
        """With the condition held: every entry read so far; a shard's error is raised
        (after the entries of other shards, which come first)."""
        entries = [e for r in self._results if isinstance(r, list) for e in r]
        errors = [r for r in self._results if isinstance(r, Exception)]
        self._results.clear()
        self._queued -= len(entries)
        if errors and not entries:  # else dropped: the failing shard backs off by itself
            raise errors[0]
        return entries

    def _serve(self, shard: int) -> None:
        """A shard's thread: wait for a budget, read (blocking), hand the result over."""
        reader, delays = self.readers[shard], backoff_delays()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._grants[shard] > 0 or self._closed)
                if self._closed:
                    return
                count = self._grants[shard]
            result: Result
            try:
                result = self.localise(reader.read_new(count, self._block_ms), shard)
            except Exception as exc:  # raised in the intake's thread, which retries
                result = exc
                time.sleep(next(delays))  # while other shards' entries keep the intake busy
                connection.follow_cluster(reader.client, exc)  # the slot table as it is now
                with self._cond:
                    self._recover[shard] = "0"  # its lost reply may have delivered entries
            else:
                delays = backoff_delays()
            with self._cond:
                self._grants[shard] = 0
                if not isinstance(result, list) or result:
                    self._results.append(result)
                    self._queued += len(result) if isinstance(result, list) else 0
                self._cond.notify_all()
