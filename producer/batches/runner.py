"""The runner: whoever holds a batch's lease validates its file, admits its lines into the
model's stream in windows, settles the workers' replies into output lines, and finishes it.

Every gateway runs one, and `python -m producer batches` runs one alone. Each batch has one
holder at a time (the lease, renewed every step); when a holder dies, the lease lapses and
another takes the batch over where Redis says it is: lines in flight keep their attempt and
a due time (`takeover_s` after a takeover: the dead holder may have recorded lines it never
queued); a line due is admitted again as a new attempt; the done bitmap answers each line
once, whichever attempt answers first.

Low priority: lines go in at priority -1 (below online requests) only while the model's
backlog is under `max_backlog` (`busy_backlog` while online requests are queued): a batch
fills spare capacity. A line the workers shed (`overloaded`) is admitted again later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from producer.async_client import AsyncClient
from producer.batches import keys, lines, objects
from producer.batches.pacing import Moved, Pacing, admission_order, backlog_room, movement
from producer.batches.settling import Settlement, answered_bit, envelopes_of, settle
from producer.batches.store import READ_WINDOW, BatchStore
from producer.errors import Overloaded
from producer.gateway import jsonio, metrics
from producer.gateway.errors import ApiError
from producer.liveness import Kind

log = structlog.get_logger("redbatch.batches")
BATCH_PRIORITY = -1  # below every online request (their default is 0)
STALE_MS = 60_000  # an active id with no batch this long after it was listed: a lost create
KindOf = Callable[[str], Awaitable[tuple[bool, Kind | None]]]  # model -> (known, kind)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    # at most half a CPU worker's max_inflight (512), so held-back lines never fill it: at
    # 512 online calls waited in the stream behind them (p99 1-10 s, bench.batches)
    window: int = 256  # lines of one batch in flight at most
    max_backlog: int = 256  # admit only while the model's stream holds fewer unacked entries
    busy_backlog: int = 2  # the batch's own lines queued, while online requests are queued too
    lease_s: float = 15.0
    flight_timeout_s: float = 900.0  # a line admitted this long ago, unanswered, goes again
    takeover_s: float = 30.0  # lines in flight when a batch is taken over go again this soon
    poll_s: float = 0.2  # between rounds with nothing in flight
    # with lines in flight: at 0.2 s the workers finished a window and idled until the
    # next round (25 % of the run, bench.batches); a round costs 4 round trips
    flight_poll_s: float = 0.02
    busy_poll_s: float = 0.005  # between rounds that settled or admitted lines
    max_lines: int = 50_000
    max_line_bytes: int = 4 << 20
    max_inputs: int = 2048
    retry_ms: int = 1000  # a shed line waits this long when the worker named no time


class Runner:
    def __init__(self, store: BatchStore, client: Callable[[str], AsyncClient],
                 kind_of: KindOf, config: RunnerConfig, holder: str) -> None:
        self.store, self.client, self.kind_of = store, client, kind_of
        self.config, self.holder = config, holder
        self.rates: dict[str, tuple[float, float | None]] = {}  # batch -> (lines/s, ETA s)
        self.pacing: dict[str, Pacing] = {}  # batch -> its window (AIMD on shed lines)

    async def run(self, stop: asyncio.Event) -> None:
        """Step the batches until `stop`; a failure is logged, the batch tried next round."""
        cfg = self.config
        waits = {Moved.IDLE: cfg.poll_s, Moved.WAITING: cfg.flight_poll_s,
                 Moved.MOVED: cfg.busy_poll_s}
        while not stop.is_set():
            moved = Moved.IDLE
            try:
                moved = await self.round()
            except Exception as exc:  # Redis down, a bug: the runner must outlive it
                log.warning("batch_runner_failed", error=f"{type(exc).__name__}: {exc}")
            try:  # a fixed poll would cap a batch at max_backlog lines a poll
                await asyncio.wait_for(stop.wait(), waits[moved])
            except TimeoutError:
                pass

    async def round(self) -> Moved:
        """Step every batch this runner holds; the most any of them moved."""
        lease_ms, moved = int(self.config.lease_s * 1000), Moved.IDLE
        takeover_ms = int((time.time() + self.config.takeover_s) * 1000)
        for batch_id, listed_ms in await self.store.active():
            try:
                if await self.store.lease(batch_id, self.holder, lease_ms, takeover_ms):
                    moved = max(moved, await self.step(batch_id, listed_ms))
            except Exception as exc:  # one batch's fault must not stall the others
                log.warning("batch_step_failed", batch=batch_id,
                            error=f"{type(exc).__name__}: {exc}")
        return moved

    async def step(self, batch_id: str, listed_ms: int = 0) -> Moved:
        """One move of the batch: validate it, or settle and admit, or finish it."""
        meta = await self.store.batch_meta(batch_id)
        status = objects.text(meta, "status")
        if status is None and time.time() * 1000 - listed_ms < STALE_MS:
            return Moved.IDLE  # listed, its hash not written yet: a create under way
        if status is None or status in objects.FINAL:
            self.forget(batch_id)
            await self.store.retire(batch_id)
        elif status == objects.VALIDATING:
            await self.validate(batch_id, meta)
            return Moved.MOVED
        elif status == objects.CANCELLING:
            await self.close(batch_id, meta, objects.CANCELLED, lines.CANCELLED)
        elif time.time() >= (objects.integer(meta, "expires_at") or 0):
            await self.close(batch_id, meta, objects.EXPIRED, lines.EXPIRED)
        else:
            return await self.advance(batch_id, meta)
        return Moved.IDLE

    def forget(self, batch_id: str) -> None:
        if self.rates.pop(batch_id, None) is not None:
            for gauge in (metrics.BATCH_RATE, metrics.BATCH_ETA):
                gauge.remove(batch_id)
        self.pacing.pop(batch_id, None)
        metrics.BATCHES_HELD.set(len(self.rates))

    def measured(self, batch_id: str, rate: tuple[float, float | None]) -> None:
        """The batch's lines/s and ETA, for /metrics and `python -m worker stats`."""
        self.rates[batch_id] = rate
        metrics.BATCH_RATE.labels(batch_id).set(rate[0])
        metrics.BATCH_ETA.labels(batch_id).set(-1 if rate[1] is None else rate[1])
        metrics.BATCHES_HELD.set(len(self.rates))

    async def validate(self, batch_id: str, meta: dict[bytes, bytes]) -> None:
        """Every line checked before any is queued; a file that fails fails the batch."""
        cfg, endpoint = self.config, objects.text(meta, "endpoint") or ""
        checker = lines.Validator(endpoint, cfg.max_lines, cfg.max_line_bytes)
        file_id = objects.text(meta, "input_file_id") or ""
        count = objects.integer(await self.store.file_meta(file_id), "lines")
        if count is None:
            checker.errors.append(lines.problem(
                "file_not_found", f"the input file {file_id} is gone", "input_file_id"))
        sizes: list[int] = []
        for start in range(0, min(count or 0, cfg.max_lines + 1), READ_WINDOW):
            window = range(start, min(start + READ_WINDOW, count or 0))
            for number, raw in zip(window, await self.store.read_lines(file_id, window),
                                   strict=True):
                checker.feed(number + 1, raw or b"")
                sizes.append(len(raw or b""))
        errors = checker.finish()
        if not errors and checker.model is not None:
            errors = await self.model_problems(checker.model, endpoint)
        status = objects.FAILED if errors else objects.IN_PROGRESS
        listed = jsonio.dumps({"object": "list", "data": errors}).decode() if errors else ""
        order = [] if errors else admission_order(sizes)
        await self.store.start(batch_id, status, int(time.time()), checker.lines, listed,
                               checker.model or "", order)
        log.info("batch_validated", batch=batch_id, status=status, lines=checker.lines)

    async def model_problems(self, model: str, endpoint: str) -> list[dict[str, Any]]:
        known, kind = await self.kind_of(model)
        if not known:
            return [lines.problem("model_not_found", f"the model {model!r} does not exist",
                                  "body.model")]
        if kind is not None and kind is not lines.ENDPOINTS[endpoint]:
            return [lines.problem("invalid_model", f"the model {model!r} is a {kind.value} "
                                  f"model, which {endpoint} does not serve", "body.model")]
        return []

    async def advance(self, batch_id: str, meta: dict[bytes, bytes]) -> Moved:
        """Settle the replies in hand, finish if every line is answered, else admit."""
        cfg, now_ms = self.config, int(time.time() * 1000)
        replies, done, flying, due, waiting = await self.store.progress(
            batch_id, cfg.window * 4, now_ms, cfg.window)
        settled = await self.settle_replies(batch_id, meta, replies, done)
        answered = (objects.integer(meta, "completed") or 0) + \
            (objects.integer(meta, "failed") or 0) + settled
        total = objects.integer(meta, "total") or 0
        self.measured(batch_id, objects.rate({**meta, b"completed": str(answered).encode(),
                                              b"failed": b"0"}, now_ms / 1000))
        if answered >= total:
            await self.store.finish(batch_id, objects.COMPLETED, int(now_ms / 1000), True, [])
            log.info("batch_completed", batch=batch_id, lines=total)
            return Moved.MOVED
        # in the model's stream or being computed: in flight, no reply yet, not due again
        queued = flying - waiting - len(due)
        admitted = await self.admit(batch_id, meta, flying - len(due), due, queued)
        return movement(bool(admitted or replies), queued)

    async def settle_replies(self, batch_id: str, meta: dict[bytes, bytes],
                             replies: list[bytes], done: bytes) -> int:
        if not replies:
            return 0
        # CPU work, in a thread: the event loop (online calls) gets the GIL between slices
        envelopes, wanted = await asyncio.to_thread(envelopes_of, replies)
        if not wanted:  # none of this batch's: drop them
            return await self.save(batch_id, len(replies), Settlement())
        file_id = objects.text(meta, "input_file_id") or ""
        raws = dict(zip(wanted, await self.store.read_lines(file_id, wanted), strict=True))
        created, now_ms = objects.integer(meta, "created_at") or 0, int(time.time() * 1000)
        args = (batch_id, envelopes, raws, done, self.config.max_inputs, created, now_ms,
                self.config.retry_ms)
        result = await asyncio.to_thread(settle, *args)
        if result.needs_parts:  # a line of several requests: the parts seen before
            stored = await self.store.parts(batch_id, result.needs_parts)
            result = await asyncio.to_thread(
                settle, *args, dict(zip(result.needs_parts, stored, strict=True)))
        pacing = self.pacing.setdefault(batch_id, Pacing(self.config.window))
        pacing.settled(len(result.answers), len(result.retries))
        return await self.save(batch_id, len(replies), result)

    async def save(self, batch_id: str, handled: int, result: Settlement) -> int:
        for _, ok, _ in result.answers:
            metrics.BATCH_LINES.labels("completed" if ok else "failed").inc()
        return await self.store.settle(batch_id, handled, result.answers, result.retries,
                                       result.kept, result.dropped)

    async def admit(self, batch_id: str, meta: dict[bytes, bytes], flying: int,
                    due: list[int], queued: int) -> int:
        """The next window: lines due again first, then new ones, as the backlog allows;
        how many lines went."""
        cfg = self.config
        model = objects.text(meta, "model") or ""
        client = self.client(model)
        backlog = await self.store.backlog(model, client.group, cfg.max_backlog + 1)
        window = self.pacing.setdefault(batch_id, Pacing(cfg.window)).window
        room = min(window - max(flying, 0),
                   backlog_room(cfg.max_backlog, cfg.busy_backlog, backlog, queued))
        if room <= 0:
            return 0
        cursor, total = objects.integer(meta, "cursor") or 0, objects.integer(meta, "total") or 0
        again = due[:room]
        fresh = await self.store.ordered(batch_id, cursor,
                                         min(total, cursor + room - len(again)) - cursor)
        attempts = [a + 1 for a in await self.store.attempts(batch_id, again)] + [1] * len(fresh)
        chosen = again + fresh
        if not chosen:
            return 0
        raws = await self.store.read_lines(objects.text(meta, "input_file_id") or "", chosen)
        await self.send(batch_id, meta, client, list(zip(chosen, attempts, raws, strict=True)),
                        cursor + len(fresh))
        return len(chosen)

    async def send(self, batch_id: str, meta: dict[bytes, bytes], client: AsyncClient,
                   chosen: list[tuple[int, int, bytes | None]], cursor: int) -> None:
        """Record the lines as in flight, then enqueue their requests; a line whose body
        the route would refuse is answered at once (its 400), a shed window goes again."""
        cfg, now_ms = self.config, int(time.time() * 1000)
        created = objects.integer(meta, "created_at") or 0
        payloads, ids, refused = [], [], []
        for line, attempt, raw in chosen:
            try:
                work = lines.work_of(lines.read_line(raw or b"", cfg.max_line_bytes),
                                     cfg.max_inputs, created)
            except (ApiError, lines.LineProblem) as exc:
                rid = keys.request_id(batch_id, line, attempt, 0)
                refused.append((line, False, lines.refusal_line(rid, raw, exc)))
                continue
            for part, payload in enumerate(work.payloads):
                payloads.append(payload)
                ids.append(keys.request_id(batch_id, line, attempt, part))
        pairs = [(line, attempt) for line, attempt, _ in chosen]
        if await self.store.admit(batch_id, cursor, now_ms + int(cfg.flight_timeout_s * 1000),
                                  pairs) < 0:
            return  # cancelled or finished meanwhile
        if refused:
            await self.store.settle(batch_id, 0, refused, [], [], [])
        deadline_ms = (objects.integer(meta, "expires_at") or 0) * 1000
        try:
            await client.submit_many(payloads, reply_to=self.store.keys(batch_id).reply,
                                     deadline_ms=deadline_ms, priority=BATCH_PRIORITY,
                                     request_ids=ids)
        except Overloaded as exc:
            sent = {keys.parse_request_id(i)[0] for i in exc.submitted  # type: ignore[index]
                    if keys.parse_request_id(i)}
            retry = [(line, attempt, now_ms + cfg.retry_ms) for line, attempt in pairs
                     if line not in sent]
            await self.store.settle(batch_id, 0, [], retry, [], [])

    async def close(self, batch_id: str, meta: dict[bytes, bytes], status: str,
                    why: tuple[str, str]) -> None:
        """Cancelled or expired: generations in flight are stopped, every line not answered
        gets its error line, in windows, then the batch is final (answered lines kept)."""
        await self.store.stop_in_flight(batch_id, int(self.config.flight_timeout_s * 1000))
        done = await self.store.done(batch_id)
        total = objects.integer(meta, "total") or 0
        file_id = objects.text(meta, "input_file_id") or ""
        missing = [n for n in range(total) if not answered_bit(done, n)]
        for start in range(0, len(missing), READ_WINDOW):
            window = missing[start:start + READ_WINDOW]
            raws = await self.store.read_lines(file_id, window)
            rows = [(n, jsonio.dumps(lines.unanswered(
                lines.custom_id(raw) or "", keys.request_id(batch_id, n, 0, 0), *why)))
                for n, raw in zip(window, raws, strict=True)]
            await self.store.finish(batch_id, status, int(time.time()), False, rows)
        await self.store.finish(batch_id, status, int(time.time()), True, [])
        self.forget(batch_id)
        log.info("batch_closed", batch=batch_id, status=status, unanswered=len(missing))
