"""Batching that holds a latency target: when to send a bucket's batch, how big, and whom
to refuse at once.

Each request's deadline is min(its deadline_ms, its XADD time + target). A bucket sends the
largest batch whose predicted completion (service_time.py, at the target percentile) meets
the earliest deadline among its members, less a safety margin. It waits only while waiting
raises throughput (the next arrival is expected sooner than the batch's fixed cost per
member: rate × fixed > n) and the slack stays positive. The margin follows the observed
percentile of end-to-end latency (the answers of the last 10 s): up fast when over the
target, down slowly when well under, and back to 0 when nothing was answered for 10 s;
while it is over, no batch is cut (throughput is what brings latency back). A request
predicted to miss its own deadline is answered at once; with `shed_over_target`, so is one
predicted to miss the target. Such refusals rest on predictions, and refusing everything
would leave nothing served to correct them; so while nothing is queued and no batch has
started or finished for a whole target, one request per target is admitted as a probe.

Pure: times in Unix milliseconds are passed in; the worker and the simulator both drive it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

from worker.policy.feedback import ArrivalRate, SafetyMargin
from worker.policy.service_time import ServiceTimeModel

STALE_SENT_MS = 10_000.0  # a batch sent and never started (its members all expired) is dropped


@dataclass(frozen=True, slots=True)
class Member:
    """What the policy needs of a queued request."""

    enqueued_ms: int
    deadline_ms: int | None
    length: int


@dataclass(frozen=True, slots=True)
class Decision:
    ready: bool
    size: int  # how many of the candidates to send
    reason: str  # full, token_cap, deadline, wait_paid_off, timer, waiting
    slack_ms: float  # deadline less margin less predicted completion, for the batch sent
    wait_ms: float | None = None  # not ready: decide again after this long


@dataclass(frozen=True, slots=True)
class Sent:
    """A batch sent and not yet started: its predicted end, until started() is told."""

    bucket: int
    size: int
    longest: int
    done_ms: float


@dataclass(frozen=True, slots=True)
class Admission:
    admit: bool
    code: str = ""  # deadline_exceeded or overloaded
    predicted_ms: float = 0.0  # the predicted completion's delay from now
    retry_after_ms: int = 0
    waited_ms: float = 0.0  # overloaded: since its XADD, and the margin kept below the target
    margin_ms: float = 0.0
    probe: bool = False  # admitted though predicted late: nothing ran to check the prediction


class LatencyPolicy:
    def __init__(self, target_ms: float, percentile: float, buckets: int, instances: int = 1,
                 shed_over_target: bool = False) -> None:
        self.target_ms = target_ms
        self.shed_over_target = shed_over_target
        self.model = ServiceTimeModel(buckets, percentile)
        self.margin = SafetyMargin(target_ms, percentile)
        self.rates = [ArrivalRate() for _ in range(buckets)]
        self.busy_until_ms = [0.0] * instances
        self.active_ms = float("-inf")  # the last batch start or end
        self.probed_ms = float("-inf")  # the last probe admitted
        # A batch sent is known from its dispatch until started() is told, just before its
        # launch (the compute loop first completes the batch before it).
        self.sent: list[Sent] = []

    def deadline_ms(self, member: Member) -> float:
        own = member.enqueued_ms + self.target_ms
        return own if member.deadline_ms is None else min(own, member.deadline_ms)

    # --- dispatch -----------------------------------------------------------------------------

    def decide(self, bucket: int, candidates: Sequence[Member], capped: str | None,
               now_ms: float, start_in_ms: float = 0.0, queued: int = 0) -> Decision:
        """Whether to send the bucket's batch now, and how many of `candidates` (the largest
        batch its caps allow, oldest first). `capped`: "full" or "token_cap" when the caps,
        not the queue, ended the candidates; `start_in_ms`: until this instance is free;
        `queued`: all the bucket holds (the candidates and the queue behind them). While
        the observed percentile is over the target no batch is cut: the margin has then
        grown, every deadline looks nearer, and cuts would spend forward passes the
        device needs to catch up."""
        smallest = self.sustained_size(bucket, candidates, now_ms, queued)
        if self.margin.over_target():
            smallest = len(candidates)
        size, slack = self.best_size(bucket, candidates, now_ms + start_in_ms, smallest)
        if size < len(candidates):
            return Decision(True, size, "deadline", slack)
        if slack < 0:
            return Decision(True, size, "deadline", slack)
        if capped:
            return Decision(True, size, capped, slack)
        longest = max(m.length for m in candidates)
        waited = now_ms - min(m.enqueued_ms for m in candidates)
        return self._wait_or_send(bucket, size, longest, slack, now_ms, waited)

    def best_size(self, bucket: int, candidates: Sequence[Member], start_ms: float,
                  smallest: int = 1) -> tuple[int, float]:
        """The batch size, of at least `smallest`, that gets the most members answered
        within their deadlines (the largest such), and the least slack among its members."""
        best = (-1, 0, float("-inf"))
        longest = 0
        prefix: list[float] = []  # the deadlines of the first n, sorted
        for n, member in enumerate(candidates, start=1):
            longest = max(longest, member.length)
            insort(prefix, self.deadline_ms(member) - self.margin.ms)
            done = start_ms + self.model.predict_ms(bucket, n, longest)
            in_time = n - bisect_left(prefix, done)
            if in_time >= best[0] and n >= smallest:
                best = (in_time, n, prefix[0] - done)
        return best[1], best[2]

    def sustained_size(self, bucket: int, candidates: Sequence[Member], now_ms: float,
                       queued: int = 0) -> int:
        """The smallest batch whose throughput on all instances keeps up with the bucket's
        arrivals (at most all the candidates). Sending fewer saves the oldest members only
        by lowering throughput under load: the queue behind them grows, and pays for it.
        With a queue behind the candidates (`queued`, all the bucket holds, is more), the
        rate is the larger of the decaying count and that queue's own since its oldest
        arrived: right after a step up the count still lags by its half-life. (Without one,
        a few close arrivals would look like a flood.)"""
        rate = self.rates[bucket].per_ms(now_ms)
        if queued > len(candidates) and candidates:
            rate = max(rate, queued / max(1.0, now_ms - candidates[0].enqueued_ms))
        longest = 0
        for n, member in enumerate(candidates, start=1):
            longest = max(longest, member.length)
            if len(self.busy_until_ms) * n >= rate * self.model.predict_ms(bucket, n, longest):
                return n
        return len(candidates)

    def _wait_or_send(self, bucket: int, size: int, longest: int, slack: float,
                      now_ms: float, waited_ms: float = 0.0) -> Decision:
        """Wait for the next arrival only if it comes sooner than the batch's fixed cost
        per member (then one more member raises throughput) and in time, and not once the
        oldest has waited a whole fixed cost: a wait saves at most one batch's fixed cost,
        and arrivals that stopped (a producer's pause) leave the rate estimate behind."""
        rate = self.rates[bucket].per_ms(now_ms)
        fit = self.model.fit(bucket)
        gap = 1.0 / rate if rate > 0 else float("inf")
        one_more = self.model.predict_ms(bucket, size + 1, longest) - \
            self.model.predict_ms(bucket, size, longest)
        if gap * size < fit.fixed and gap + one_more < slack and waited_ms < fit.fixed:
            return Decision(False, size, "waiting", slack, wait_ms=min(slack, 2 * gap))
        return Decision(True, size, "wait_paid_off", slack)

    # --- admission at read time ---------------------------------------------------------------

    def admit(self, member: Member, bucket: int, now_ms: float, queued_ms: float,
              batch_size: int = 1) -> Admission:
        """Answer at once a request that cannot make its deadline (or the target, less the
        margin, when shedding). `queued_ms`: predicted compute of everything queued ahead;
        `batch_size`: of the batch it is expected to join."""
        self.margin.update(now_ms)  # time passes even when nothing is answered
        free_in = self.free_in_ms(now_ms)
        ahead = queued_ms / len(self.busy_until_ms)
        delay = free_in + ahead + self.model.predict_ms(bucket, batch_size, member.length)
        completion = now_ms + delay
        refusal = None
        if member.deadline_ms is not None and completion > member.deadline_ms:
            refusal = Admission(False, "deadline_exceeded", delay)
        elif self.shed_over_target and \
                completion + self.margin.ms > member.enqueued_ms + self.target_ms:
            refusal = Admission(False, "overloaded", delay, int(free_in + ahead) + 1,
                                now_ms - member.enqueued_ms, self.margin.ms)
        if refusal is None:
            return Admission(True, predicted_ms=delay)
        if queued_ms == 0 and self._take_probe(now_ms):
            return Admission(True, predicted_ms=delay, probe=True)
        return refusal

    def _take_probe(self, now_ms: float) -> bool:
        """Whether to admit a request predicted late as a probe, recording it if so, to check
        the prediction: nothing has started or finished for a whole target (so nothing
        served has been observed), and no probe was admitted in that time. Under a real
        overload batches run back to back and no probe is due; a model inflated by an
        outlier (a cold run, a stalled machine) would otherwise refuse every request for
        good, as nothing served means nothing new observed."""
        if now_ms - max(self.active_ms, self.probed_ms) < self.target_ms:
            return False
        self.probed_ms = now_ms
        return True

    def queued_ms(self, bucket: int, size: int, longest: int, batch_cap: int) -> float:
        """Predicted compute of a bucket's queue, run as batches of `batch_cap`."""
        if not size:
            return 0.0
        batches = -(-size // batch_cap)
        per_batch = self.model.predict_ms(bucket, min(size, batch_cap), longest)
        return batches * per_batch

    def free_in_ms(self, now_ms: float) -> float:
        """Until the first instance is free: of the instances' ends and those of the batches
        sent but not started, the latest `instances` (each instance runs one at a time)."""
        ends = sorted([*self.busy_until_ms, *(s.done_ms for s in self.sent)])
        return max(0.0, ends[-len(self.busy_until_ms)] - now_ms)

    # --- feedback -----------------------------------------------------------------------------

    def dispatched(self, bucket: int, size: int, longest: int, start_ms: float) -> None:
        """A batch was sent to start at `start_ms` (now, or when the asking instance is
        free); admission counts it as busy until it ends, even before started()."""
        self.sent = [s for s in self.sent if s.done_ms > start_ms - STALE_SENT_MS]
        done = start_ms + self.model.predict_ms(bucket, size, longest)
        self.sent.append(Sent(bucket, size, longest, done))

    def arrived(self, bucket: int, now_ms: float, count: int = 1) -> None:
        self.rates[bucket].add(now_ms, count)

    def started(self, instance: int, bucket: int, size: int, longest: int,
                now_ms: float) -> None:
        """Busy from now until the predicted run ends (told just before the launch, once the
        instance's previous batch is done), and no longer counted as sent. Not until the end
        predicted at dispatch: that one began at the previous batch's predicted end, and
        chained so, each batch's over-prediction (at the target percentile, not the mean)
        would carry into the next, and an instance busy back to back look ever later."""
        for index, sent in enumerate(self.sent):
            if (sent.bucket, sent.size, sent.longest) == (bucket, size, longest):
                del self.sent[index]
                break
        self.busy_until_ms[instance] = now_ms + self.model.predict_ms(bucket, size, longest)
        self.active_ms = now_ms

    def finished(self, instance: int, bucket: int, size: int, longest: int, compute_ms: float,
                 now_ms: float) -> None:
        self.busy_until_ms[instance] = now_ms
        self.active_ms = now_ms
        self.model.observe(bucket, size, longest, compute_ms)

    def answered(self, now_ms: float, latencies_ms: Sequence[float]) -> None:
        self.margin.observe(now_ms, latencies_ms)

    def start_in_ms(self, instance: int, now_ms: float) -> float:
        return max(0.0, self.busy_until_ms[instance] - now_ms)
