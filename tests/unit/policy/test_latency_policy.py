"""The latency-target policy on its own: the service-time fit, the dispatch and wait
decisions, the safety margin and fail-fast admission. Construct, feed, call, assert."""

from __future__ import annotations

import random

import pytest

from worker.policy.feedback import LATENCY_WINDOW_MS, ArrivalRate, SafetyMargin
from worker.policy.latency import Admission, LatencyPolicy, Member
from worker.policy.service_time import CostFit, ServiceTimeModel, WindowQuantile

NOW = 1_700_000_000_000


def test_recursive_least_squares_recovers_the_fixed_and_per_token_costs() -> None:
    fit, rng = CostFit(forgetting=0.99), random.Random(0)
    for _ in range(300):
        tokens = rng.randint(16, 4096)
        fit.update(tokens, 10.0 + 0.2 * tokens)
    assert fit.fixed == pytest.approx(10.0, abs=0.5)
    assert fit.per_token == pytest.approx(0.2, rel=0.01)


def test_forgetting_follows_a_device_that_slows_down() -> None:
    fit = CostFit(forgetting=0.9)
    for tokens in [100, 2000] * 50:
        fit.update(tokens, 10.0 + 0.2 * tokens)
    for tokens in [100, 2000] * 50:
        fit.update(tokens, 1.5 * (10.0 + 0.2 * tokens))
    assert fit.predict(1000) == pytest.approx(1.5 * 210.0, rel=0.02)


def test_the_prediction_covers_the_percentile_not_the_mean() -> None:
    model, rng = ServiceTimeModel(buckets=1, percentile=0.9), random.Random(1)
    for _ in range(600):
        model.observe(0, 8, 16, (10.0 + 0.1 * 128) * rng.uniform(0.8, 1.2))
    assert model.mean_ms(0, 8, 16) == pytest.approx(22.8, rel=0.1)
    assert model.predict_ms(0, 8, 16) == pytest.approx(22.8 * 1.16, rel=0.06)


def test_a_bucket_uses_the_overall_fit_until_it_has_its_own() -> None:
    model = ServiceTimeModel(buckets=2, percentile=0.5)
    for _ in range(10):
        model.observe(0, 4, 10, 50.0)
    assert model.fit(1) is model.overall
    assert model.fit(0) is model.fits[0]


def test_window_quantile_is_nearest_rank_over_the_window() -> None:
    quantile = WindowQuantile(0.99, size=100)
    for value in range(1000):
        quantile.add(float(value))
    assert quantile.value(0.0) == 999.0 and len(quantile.values) == 100


def trained(target_ms: float = 100.0, fixed: float = 10.0, per_token: float = 1.0,
            instances: int = 1, shed: bool = False) -> LatencyPolicy:
    policy = LatencyPolicy(target_ms, 0.99, buckets=1, instances=instances,
                           shed_over_target=shed)
    for size in [1, 4, 16, 32] * 10:
        policy.model.observe(0, size, 1, fixed + per_token * size)
    return policy


def members(count: int, enqueued: int = NOW, deadline: int | None = None) -> list[Member]:
    return [Member(enqueued, deadline, 1) for _ in range(count)]


def test_a_full_batch_leaves_at_once() -> None:
    decision = trained().decide(0, members(32), "full", NOW)
    assert (decision.ready, decision.size, decision.reason) == (True, 32, "full")
    assert decision.slack_ms == pytest.approx(100 - 42, abs=2)


def test_a_token_capped_batch_says_so() -> None:
    assert trained().decide(0, members(8), "token_cap", NOW).reason == "token_cap"


def test_the_batch_shrinks_to_what_still_meets_its_deadlines() -> None:
    """60 ms of the 100 ms target are gone: 32 would end at 102 ms, 20 at 90."""
    decision = trained().decide(0, members(32, enqueued=NOW - 60), None, NOW)
    assert decision.ready and decision.reason == "deadline"
    assert 20 <= decision.size <= 30


def test_under_load_it_does_not_shrink_below_what_keeps_up_with_arrivals() -> None:
    """At 1.3 arrivals per ms one instance needs batches of 32 (32 per 42 ms): a batch of
    20 would save its oldest members and make the whole queue behind them late."""
    loaded, quiet = trained(), trained()
    for t in range(0, 3000):
        loaded.arrived(0, NOW - 3000 + t, count=1 + (t % 10 < 3))
    assert loaded.sustained_size(0, members(32), NOW) >= 30
    assert quiet.sustained_size(0, members(32), NOW) == 1
    decision = loaded.decide(0, members(32, enqueued=NOW - 60), None, NOW)
    assert decision.ready and decision.size >= 30


def test_right_after_a_step_up_the_queue_shows_the_rate_the_count_has_not_caught() -> None:
    """40 queued within the last 30 ms: 1.3 per ms, whatever the decaying count says."""
    policy = trained()
    policy.arrived(0, NOW - 3000)
    queue = members(32, enqueued=NOW - 30)
    assert policy.sustained_size(0, queue, NOW) == 1
    assert policy.sustained_size(0, queue, NOW, queued=40) == 32
    due = members(32, enqueued=NOW - 30, deadline=NOW + 35)  # 32 end at 42 ms, 24 at 34
    assert policy.decide(0, due, None, NOW).size < 32
    assert policy.decide(0, due, None, NOW, queued=40).size == 32


def test_no_cut_while_the_observed_percentile_is_over_the_target() -> None:
    """The batch that shrinks to meet its deadlines goes whole once answers run late."""
    policy = trained()
    policy.answered(NOW - 1000, [99.0] * 50)
    assert not policy.margin.over_target()
    assert policy.decide(0, members(32, enqueued=NOW - 60), None, NOW).size < 32
    policy.answered(NOW, [150.0] * 50)  # p99 of the window over the 100 ms target
    assert policy.margin.over_target()
    decision = policy.decide(0, members(32, enqueued=NOW - 60), None, NOW)
    assert decision.ready and decision.size == 32 and decision.reason == "deadline"


def test_a_batch_that_is_late_anyway_goes_whole() -> None:
    decision = trained().decide(0, members(10, enqueued=NOW - 500), None, NOW)
    assert decision.ready and decision.size == 10 and decision.slack_ms < 0


def test_it_waits_only_while_the_next_arrival_raises_throughput() -> None:
    busy, quiet = trained(), trained()
    for t in range(0, 3000):  # an arrival every ms: sooner than 10 ms fixed / 2 members
        busy.arrived(0, NOW - 3000 + t)
    waiting = busy.decide(0, members(2), None, NOW)
    assert not waiting.ready and waiting.reason == "waiting" and 0 < waiting.wait_ms < 100
    quiet.arrived(0, NOW - 100)  # one arrival: the next is not worth waiting for
    sent = quiet.decide(0, members(2), None, NOW)
    assert sent.ready and sent.reason == "wait_paid_off"


def test_no_wait_once_the_oldest_has_waited_a_whole_fixed_cost() -> None:
    """The arrivals stopped (the rate estimate still says one per ms): a wait saves at most
    one batch's fixed cost, so the oldest does not wait for its deadline."""
    policy = trained()
    for t in range(0, 3000):
        policy.arrived(0, NOW - 3000 + t)
    assert not policy.decide(0, members(2, enqueued=NOW - 5), None, NOW).ready
    assert policy.decide(0, members(2, enqueued=NOW - 12), None, NOW).ready


def test_no_wait_when_the_slack_would_run_out() -> None:
    policy = trained()
    for t in range(0, 3000):
        policy.arrived(0, NOW - 3000 + t)
    decision = policy.decide(0, members(4, enqueued=NOW - 85), None, NOW)
    assert decision.ready


def test_a_busy_instance_counts_its_remaining_time() -> None:
    free, busy = trained(), trained()
    assert free.decide(0, members(32, enqueued=NOW - 40), None, NOW).size == 32
    assert busy.decide(0, members(32, enqueued=NOW - 40), None, NOW, start_in_ms=30).size < 32


def test_the_margin_rises_fast_over_the_target_and_falls_slowly_under_it() -> None:
    margin = SafetyMargin(target_ms=100.0, percentile=0.99)
    margin.observe(NOW, [150.0] * 100)
    assert margin.ms == pytest.approx(10.0)
    margin.observe(NOW + 100, [150.0])
    assert margin.ms == pytest.approx(10.0)  # at most one step per update period
    margin.observe(NOW + 300, [150.0])
    assert margin.ms == pytest.approx(20.0)
    margin.observed = WindowQuantile(0.99, 100)
    margin.observe(NOW + 600, [90.0] * 100)  # under the target, not well under: kept
    assert margin.ms == pytest.approx(20.0)
    margin.observed = WindowQuantile(0.99, 100)
    margin.observe(NOW + 900, [40.0] * 100)
    assert margin.ms == pytest.approx(19.0)


def test_a_margin_raised_by_a_burst_cannot_shed_every_request_for_good() -> None:
    """While shedding refuses everything nothing is answered, so nothing new is observed:
    the answers of the burst leave the window after LATENCY_WINDOW_MS, and the margin
    goes with them. (A fixed cost of 50 ms: with the margin at its cap, no request fits.)"""
    policy = trained(fixed=50.0, shed=True)
    for step in range(20):
        policy.answered(NOW + 300 * step, [1700.0] * 50)
        policy.finished(0, 0, 32, 1, 40.0, NOW + 300 * step)  # batches ran: no probe due
    assert policy.margin.ms == pytest.approx(60.0)
    last = NOW + 300 * 19
    assert not policy.admit(Member(last, None, 1), 0, last, queued_ms=0.0).admit
    later = last + LATENCY_WINDOW_MS - 300
    policy.finished(0, 0, 32, 1, 40.0, later - 50)
    assert not policy.admit(Member(later, None, 1), 0, later, queued_ms=0.0).admit
    after = last + LATENCY_WINDOW_MS + 300
    assert policy.admit(Member(after, None, 1), 0, after, queued_ms=0.0).admit
    assert policy.margin.ms == 0.0


def test_an_idle_device_admits_a_probe_per_target_so_a_bad_prediction_is_corrected() -> None:
    """A model fitted on an outlier (a cold run of 900 ms here) predicts every
    request late, and refusing them all would observe nothing to correct it. With nothing
    queued and no batch run for a whole target, one request per target is admitted."""
    policy = LatencyPolicy(100.0, 0.99, buckets=1, shed_over_target=True)
    policy.model.observe(0, 1, 1, 900.0)
    first = policy.admit(Member(NOW, None, 1), 0, NOW, queued_ms=0.0)
    assert first.admit and first.probe
    assert not policy.admit(Member(NOW + 5, None, 1), 0, NOW + 5, queued_ms=0.0).admit
    policy.started(0, 0, 1, 1, NOW + 10)
    policy.finished(0, 0, 1, 1, 11.0, NOW + 21)
    assert not policy.admit(Member(NOW + 90, None, 1), 0, NOW + 90, queued_ms=0.0).admit
    second = policy.admit(Member(NOW + 125, None, 1), 0, NOW + 125, queued_ms=0.0)
    assert second.admit and second.probe  # a target after the last batch ended
    with_deadline = policy.admit(Member(NOW + 300, NOW + 400, 1), 0, NOW + 300, queued_ms=0.0)
    assert with_deadline.admit and with_deadline.probe  # fail-fast rests on it too
    queued = policy.admit(Member(NOW + 900, None, 1), 0, NOW + 900, queued_ms=5.0)
    assert not queued.admit  # work is waiting: it will be observed, no probe needed
    for _ in range(8):  # the probes' answers bring the prediction down
        policy.model.observe(0, 1, 1, 11.0)
    assert policy.admit(Member(NOW + 950, None, 1), 0, NOW + 950, queued_ms=0.0) == \
        Admission(True, predicted_ms=policy.model.predict_ms(0, 1, 1))


def test_old_answers_leave_the_observed_window() -> None:
    margin = SafetyMargin(target_ms=100.0, percentile=0.99)
    margin.observe(NOW, [500.0] * 10)
    margin.observe(NOW + 5000, [50.0] * 10)
    assert margin.observed.value(0.0) == 500.0
    margin.update(NOW + LATENCY_WINDOW_MS + 300)
    assert margin.observed.value(0.0) == 50.0


def test_the_margin_is_capped() -> None:
    margin = SafetyMargin(target_ms=100.0, percentile=0.5)
    for step in range(20):
        margin.observe(NOW + 300 * step, [500.0])
    assert margin.ms == pytest.approx(60.0)


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once() -> None:
    policy = trained()
    refused = policy.admit(Member(NOW, NOW + 15, 1), 0, NOW, queued_ms=40.0)
    assert not refused.admit and refused.code == "deadline_exceeded"
    assert policy.admit(Member(NOW, NOW + 80, 1), 0, NOW, queued_ms=40.0).admit


def test_shedding_refuses_what_would_miss_the_target_with_a_retry_time() -> None:
    shedding, keeping = trained(shed=True), trained()
    refused = shedding.admit(Member(NOW, None, 1), 0, NOW, queued_ms=200.0)
    assert not refused.admit and refused.code == "overloaded"
    assert refused.retry_after_ms == 201
    late = shedding.admit(Member(NOW - 30, None, 1), 0, NOW, queued_ms=200.0)
    assert (late.waited_ms, late.margin_ms) == (30.0, shedding.margin.ms)  # for its message
    assert keeping.admit(Member(NOW, None, 1), 0, NOW, queued_ms=200.0).admit


def test_several_instances_share_the_queue_ahead() -> None:
    one, two = trained(shed=True), trained(shed=True, instances=2)
    request = Member(NOW, None, 1)
    assert not one.admit(request, 0, NOW, queued_ms=150.0).admit
    assert two.admit(request, 0, NOW, queued_ms=150.0).admit


def test_busy_until_is_kept_per_instance() -> None:
    policy = trained(instances=2)
    policy.started(0, 0, 32, 1, NOW)
    assert policy.start_in_ms(0, NOW) == pytest.approx(42, abs=2)
    assert policy.start_in_ms(1, NOW) == 0
    policy.finished(0, 0, 32, 1, 40.0, NOW + 40)
    assert policy.start_in_ms(0, NOW + 40) == 0


def test_a_batch_sent_counts_as_busy_before_its_start_is_told() -> None:
    """A batch is counted from its dispatch, so admission sees the instance busy before
    the compute loop says it started (just before the launch)."""
    policy, request = trained(instances=1, shed=True), Member(NOW + 10, None, 1)
    assert policy.admit(request, 0, NOW + 10, queued_ms=60.0).admit
    policy.dispatched(0, 32, 1, NOW)
    assert policy.free_in_ms(NOW + 10) == pytest.approx(32, abs=2)
    assert not policy.admit(request, 0, NOW + 10, queued_ms=60.0).admit
    policy.started(0, 0, 32, 1, NOW + 10)
    assert policy.start_in_ms(0, NOW + 10) == pytest.approx(42, abs=2) and not policy.sent
    policy.finished(0, 0, 32, 1, 42.0, NOW + 52)
    assert policy.free_in_ms(NOW + 52) == 0


def test_back_to_back_batches_do_not_carry_over_predictions() -> None:
    """The compute loop asks for batch k+1 while k is its running one, so k+1 is sent to
    start at k's predicted end; once k is done early, k+1 starts now. Predicted 42 ms and
    run in 30, a hundred batches back to back leave the instance at most one run busy."""
    policy = trained(instances=1)
    now = NOW
    policy.started(0, 0, 32, 1, now)
    for _ in range(100):
        now += 30  # k is done, and the loop asks for k+1 before telling k finished
        policy.dispatched(0, 32, 1, now + policy.start_in_ms(0, now))
        policy.finished(0, 0, 32, 1, 30.0, now)
        policy.started(0, 0, 32, 1, now)
    assert policy.start_in_ms(0, now) <= policy.model.predict_ms(0, 32, 1) + 1
    assert not policy.sent


def test_with_two_instances_one_free_one_sent_the_free_one_is_first() -> None:
    policy = trained(instances=2)
    policy.dispatched(0, 32, 1, NOW)
    assert policy.free_in_ms(NOW) == 0
    policy.dispatched(0, 16, 1, NOW)
    assert policy.free_in_ms(NOW) == pytest.approx(26, abs=2)


def test_a_batch_sent_and_never_started_is_forgotten() -> None:
    policy = trained()
    policy.dispatched(0, 32, 1, NOW)
    policy.dispatched(0, 8, 1, NOW + 60_000)
    assert len(policy.sent) == 1 and policy.free_in_ms(NOW + 60_000) > 0


def test_the_arrival_rate_decays_without_arrivals() -> None:
    rate = ArrivalRate(half_life_ms=1000)
    for t in range(0, 10_000, 10):
        rate.add(NOW + t)
    assert rate.per_ms(NOW + 10_000) == pytest.approx(0.1, rel=0.1)
    assert rate.per_ms(NOW + 12_000) == pytest.approx(0.025, rel=0.15)
