"""BentoML's CorkDispatcher (issue 13, baseline 5; worker/policy/cork.py): the pure rule the
simulator and the worker share, its hook on the Batcher, its settings, and a worker that
runs it through Redis (`batch_controller = "cork"`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from producer import Client, protocol
from producer.protocol import DEFAULT_GROUP, MSGPACK
from producer.request_entry import Request
from worker.app import StartupError, assemble_worker
from worker.execution.executor import Executor, resolve_device
from worker.models import create_model
from worker.models.base import Prepared
from worker.policy.batching import Batcher, BatchLimits, Pending
from worker.policy.controllers import controller_from_settings, dispatch_rule
from worker.policy.cork import TICK_MS, CorkDecision, CorkDispatch, CorkRule, least_squares
from worker.policy.latency import LatencyPolicy
from worker.policy.targeted import TargetedDispatch
from worker.settings import SettingsError, load_settings

TARGET_MS = 100.0


def fitted(per_item: float, fixed: float, mean_wait: float = 0.0, cap: int = 8,
           target_ms: float = TARGET_MS) -> CorkRule:
    """A rule as if it had already fitted latency = per_item·n + fixed."""
    rule = CorkRule(target_ms, cap)
    rule.per_item, rule.fixed, rule.mean_wait = per_item, fixed, mean_wait
    return rule


# --- the fit: latency = a·n + b by least squares over the last batches ---

def test_least_squares_recovers_slope_and_intercept() -> None:
    assert least_squares([(1, 12.0), (2, 14.0), (4, 18.0)]) == pytest.approx((2.0, 10.0))


def test_least_squares_of_one_batch_size_is_the_mean_time() -> None:
    assert least_squares([(4, 10.0), (4, 20.0)]) == (0.0, 15.0)


def test_least_squares_never_returns_a_negative_slope_or_intercept() -> None:
    assert least_squares([(1, 20.0), (2, 10.0)]) == (0.0, 30.0)  # slope -10: clamped
    assert least_squares([(1, 1.0), (10, 100.0)]) == pytest.approx((11.0, 0.0))  # b = -10


def test_the_fit_starts_with_the_second_batch() -> None:
    rule = CorkRule(TARGET_MS, 8)
    rule.finished(4, 30.0)
    assert (rule.per_item, rule.fixed) == (0.0, 0.0)
    rule.finished(8, 50.0)
    assert (rule.per_item, rule.fixed) == pytest.approx((5.0, 10.0))


def test_the_fit_looks_back_over_its_history_only() -> None:
    rule = CorkRule(TARGET_MS, 8, history=3)
    for size, ms in [(1, 500.0), (1, 12.0), (2, 14.0), (4, 18.0)]:
        rule.finished(size, ms)
    assert (rule.per_item, rule.fixed) == pytest.approx((2.0, 10.0))  # the 500 ms is gone
    assert CorkRule(TARGET_MS, 8).batches.maxlen == 50


# --- refusal: the oldest first, while its age + a·n + b >= the target ---

def test_a_request_is_refused_once_its_age_plus_the_fit_reaches_the_target() -> None:
    rule = fitted(per_item=2.0, fixed=10.0)
    arrivals = [0.0, 10.0, 20.0, 30.0]  # n = 4: a·n + b = 18
    assert rule.refusals(81.9, arrivals) == 0
    assert rule.refusals(82.0, arrivals) == 1  # 82 + 18 = 100: at the target is refused
    assert rule.refusals(93.9, arrivals) == 1  # then 83.9 + 16 < 100
    assert rule.refusals(94.0, arrivals) == 2  # 94 + 18, then 84 + 16 = 100; 74 + 14 < 100


def test_refusal_counts_the_whole_queue_not_the_batch_cap() -> None:
    rule = fitted(per_item=2.0, fixed=0.0, cap=2)
    assert rule.refusals(80.0, [0.0] * 10) == 1  # 80 + 2 x 10 = 100, not 80 + 2 x 2
    assert rule.refusals(80.0, [0.0] * 9) == 0


def test_the_last_request_is_never_refused() -> None:
    rule = fitted(per_item=1.0, fixed=1.0)
    assert rule.refusals(5000.0, [0.0]) == 0
    assert rule.refusals(5000.0, [0.0, 1.0, 2.0]) == 2


def test_without_a_fit_only_age_counts() -> None:
    rule = CorkRule(TARGET_MS, 8)
    assert rule.refusals(99.0, [0.0, 50.0]) == 0
    assert rule.refusals(100.0, [0.0, 50.0]) == 1


# --- waiting: while n·(age of the newest + a) <= 0.95 × the mean wait and n < cap ---

def test_waiting_pays_up_to_0_95_of_the_mean_wait() -> None:
    rule = fitted(per_item=2.0, fixed=10.0, mean_wait=100.0)
    assert rule.waits(4, 21.75)  # 4 x (21.75 + 2) = 95 = 0.95 x 100
    assert not rule.waits(4, 21.76)
    assert rule.waits(1, 93.0) and not rule.waits(1, 93.1)


def test_a_full_queue_never_waits() -> None:
    rule = fitted(per_item=0.0, fixed=0.0, mean_wait=1e9, cap=8)
    assert rule.waits(7, 0.0)
    assert not rule.waits(8, 0.0) and not rule.waits(20, 0.0)


def test_with_no_mean_wait_yet_waiting_never_pays() -> None:
    assert not CorkRule(TARGET_MS, 8).waits(1, 0.001)


# --- the mean wait: an EWMA (0.9, 0.1) of the oldest member's age at dispatch ---

def test_the_mean_wait_moves_a_tenth_towards_each_dispatch() -> None:
    rule = CorkRule(TARGET_MS, 8)
    rule.dispatched(50.0)
    assert rule.mean_wait == pytest.approx(5.0)
    rule.dispatched(100.0)
    assert rule.mean_wait == pytest.approx(0.9 * 5.0 + 10.0)


def test_a_dispatch_takes_the_oldest_up_to_the_cap_and_moves_the_mean_wait() -> None:
    rule = fitted(per_item=1.0, fixed=0.0, cap=3)
    decision = rule.decide(95.0, [0.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    assert decision == CorkDecision(refuse=1, take=3)  # 95 + 6 >= 100; 85 + 5 < 100
    assert rule.mean_wait == pytest.approx(0.1 * 85.0)  # the oldest left, not the refused


def test_decide_refuses_yet_keeps_the_rest_waiting() -> None:
    rule = fitted(per_item=1.0, fixed=0.0, mean_wait=1000.0)
    assert rule.decide(99.0, [0.0, 90.0, 95.0]) == CorkDecision(refuse=1, take=0)
    assert rule.mean_wait == 1000.0  # no dispatch, no update


def test_flush_dispatches_instead_of_waiting() -> None:
    rule = fitted(per_item=1.0, fixed=0.0, mean_wait=1000.0)
    assert rule.decide(10.0, [5.0, 6.0], flush=True) == CorkDecision(refuse=0, take=2)
    assert rule.decide(10.0, []) == CorkDecision(0, 0)


def test_the_wake_up_is_when_waiting_stops_paying_or_the_oldest_gets_late() -> None:
    rule = fitted(per_item=2.0, fixed=10.0, mean_wait=100.0)
    assert rule.wait_ms(10.0, [0.0, 5.0]) == pytest.approx(95 / 2 - 2 - 5)  # before refusal
    assert rule.wait_ms(60.0, [0.0, 59.0]) == pytest.approx(100 - 4 - 10 - 60)
    assert rule.wait_ms(85.9, [0.0, 85.0]) == TICK_MS == 1.0  # never under BentoML's tick
    full = fitted(per_item=2.0, fixed=10.0, mean_wait=100.0, cap=2)
    assert full.wait_ms(10.0, [0.0, 5.0]) == pytest.approx(76.0)  # a full batch never waits
    assert rule.wait_ms(0.0, []) is None


def test_a_refusal_is_told_to_retry_after_the_queue_left_is_served() -> None:
    assert fitted(per_item=2.0, fixed=10.0).retry_after_ms(5) == 21


# --- the worker's hook: the Batcher's buckets as one FIFO queue ---

def pending(name: str, length: int, at_ms: int, deadline_ms: int | None = None) -> Pending:
    request = Request(name, b"", MSGPACK, "reply", deadline_ms)
    return Pending(f"{at_ms}-0", request, Prepared(length, None), read_at=0.0)


def cork_batcher(rule: CorkRule, max_batch_size: int = 8) -> Batcher:
    return Batcher([4], BatchLimits(max_batch_size, 1000, 0.0), targeted=CorkDispatch(rule))


def test_cork_takes_the_oldest_whatever_their_bucket() -> None:
    batcher = cork_batcher(CorkRule(1000.0, 3))
    for i, length in enumerate([1, 9, 2, 8]):
        batcher.add(pending(f"r{i}", length, 1000 + i))
    batch = batcher.next_batch(0.0, 1010)
    assert batch is not None and [p.request.id for p in batch.members] == ["r0", "r1", "r2"]
    assert batch.bucket == 1 and batch.reason == "full" and not batch.refused
    assert len(batcher) == 1 and [p.request.id for p in batcher.buckets[1].items] == ["r3"]


def test_cork_sets_its_refusals_apart_with_a_retry_after() -> None:
    batcher = cork_batcher(fitted(per_item=1.0, fixed=5.0, cap=8))
    for i in range(4):
        batcher.add(pending(f"r{i}", 1 + 5 * (i % 2), 1000 + 10 * i))
    batch = batcher.next_batch(0.0, 1092)  # 92 + 4 + 5 >= 100; 82 + 3 + 5 < 100
    assert batch is not None and [p.request.id for p in batch.refused] == ["r0"]
    assert [p.request.id for p in batch.members] == ["r1", "r2", "r3"]
    assert batch.retry_after_ms == int(1.0 * 3 + 5.0) + 1
    assert len(batcher) == 0 and not any(b.items for b in batcher.buckets)


def test_a_cork_batch_may_be_refusals_alone_and_deadlines_still_expire() -> None:
    batcher = cork_batcher(fitted(per_item=0.0, fixed=0.0, mean_wait=1e6))
    batcher.add(pending("late", 1, 1000))
    batcher.add(pending("gone", 1, 1050, deadline_ms=1060))
    batcher.add(pending("new", 1, 1099))
    batch = batcher.next_batch(0.0, 1100)  # "late" is 100 ms old; the others wait
    assert batch is not None and not batch.members and [p.request.id for p in batch.refused] \
        == ["late"]
    assert batcher.seconds_until_ready(0.0, 1100) == pytest.approx(0.050)  # "gone" late
    flushed = batcher.next_batch(0.0, 1100, flush=True)
    assert flushed is not None and [p.request.id for p in flushed.expired] == ["gone"]
    assert [p.request.id for p in flushed.members] == ["new"] and flushed.reason == "flush"


def test_cork_learns_only_from_computed_batches() -> None:
    dispatch = CorkDispatch(CorkRule(TARGET_MS, 8))
    batcher = Batcher([], BatchLimits(8, 1000, 0.0), targeted=dispatch)
    batcher.add(pending("a", 1, 1000))
    batch = batcher.next_batch(0.0, 1001)
    assert batch is not None
    dispatch.finished(batch, 12.0)
    batch.members = []
    dispatch.finished(batch, 99.0)  # refusals alone: nothing was computed
    assert list(dispatch.rule.batches) == [(1, 12.0)]


# --- settings ---

@pytest.mark.parametrize("overrides, message", [
    ({"batch_controller": "cork"}, "batch_controller 'cork' needs controller_target_ms"),
    ({"batch_controller": "cork", "controller_target_ms": 50, "latency_target_ms": 100},
     "batch_controller 'cork' is a baseline that replaces latency_target_ms"),
    ({"batch_controller": "cork", "controller_target_ms": -1},
     "invalid setting 'controller_target_ms'"),
])
def test_cork_refuses_bad_combinations_in_one_line(overrides: dict[str, object],
                                                   message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(**overrides)
    assert message in str(caught.value) and len(str(caught.value).splitlines()) == 1


def test_the_cork_setting_builds_the_dispatch_rule_not_a_controller() -> None:
    settings = load_settings(batch_controller="cork", controller_target_ms=80.0,
                             max_batch_size=16)
    targeted = TargetedDispatch(LatencyPolicy(float("inf"), 0.99, 1, 1, False))
    rule = dispatch_rule(settings, targeted)
    assert isinstance(rule, CorkDispatch)
    assert (rule.rule.target_ms, rule.rule.max_batch_size) == (80.0, 16)
    assert controller_from_settings(settings) is None
    assert dispatch_rule(load_settings(), targeted) is None
    assert dispatch_rule(load_settings(latency_target_ms=50.0), targeted) is targeted


def test_a_generative_model_refuses_cork_at_start() -> None:
    model = create_model("echo", {})
    model.generative = True  # the check comes before anything generative is built
    settings = load_settings(model="echo", batch_controller="cork", controller_target_ms=50.0,
                             metrics_port=0)
    with pytest.raises(StartupError, match="batch_controller applies to batch models"):
        assemble_worker(settings, model, Executor(model, resolve_device("cpu")),
                        client=None)  # type: ignore[arg-type]


# --- end to end: a cork worker through Redis, on the echo cost model ---

def test_a_cork_worker_refuses_what_it_cannot_serve_in_time(
        redis_url: str, r: redis.Redis, worker_factory: Callable[..., Any]) -> None:
    """18 ms per batch of 8 serves about 440 requests a second: of a burst of 300 those
    still queued near the 200 ms target are refused, each answered once, none left held."""
    client, replies, count = Client(redis_url, "echo"), "redbatch:reply:cork-replies", 300
    with worker_factory(model_options={"delay_ms": 10, "per_item_ms": 1}, instances=1,
                        max_batch_size=8, batch_controller="cork",
                        controller_target_ms=200.0) as worker:
        assert isinstance(worker.batcher.targeted, CorkDispatch)
        ids = client.submit_many([{"n": i} for i in range(count)], reply_to=replies)
        envelopes = client.collect(replies, count, timeout=30)
        time.sleep(0.3)  # room for a second answer to any of them, which must not come
    assert sorted(e["id"] for e in envelopes) == sorted(ids)
    assert r.llen(replies) == 0
    refused = [e for e in envelopes if not e["ok"]]
    served = [e for e in envelopes if e["ok"]]
    assert refused and all(e["error"]["code"] == "overloaded" for e in refused)
    assert all(e["error"]["retry_after_ms"] > 0 for e in refused)
    assert len(served) >= 8 and all(e["meta"]["batch_size"] <= 8 for e in served)
    stream = protocol.stream_key("redbatch", "echo")
    assert r.xpending(stream, DEFAULT_GROUP)["pending"] == 0
