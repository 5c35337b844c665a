"""The flow policy on its own: the in-flight cap, the drain rule, flush, claim-or-read,
yielding to an idle instance, and the wait arithmetic. Construct, feed, call, assert."""

from __future__ import annotations

import itertools
import random

import pytest

from worker.policy.backoff import backoff_delays
from worker.policy.flow import (
    FlowPolicy,
    arrival_ms,
    claims_first,
    end_to_end_s,
    entry_time_ms,
    is_past_deadline,
    queue_waits_ms,
    yields_to_idle,
)

POLICY = FlowPolicy(max_inflight=8, read_count=3)


@pytest.mark.parametrize("held, full", [(0, False), (7, False), (8, True), (9, True)])
def test_the_in_flight_cap_is_full_at_max_inflight(held: int, full: bool) -> None:
    assert POLICY.is_full(held, draining_own_pending=False) is full


@pytest.mark.parametrize("held, full", [(0, False), (1, True), (5, True)])
def test_own_pending_entries_drain_one_at_a_time(held: int, full: bool) -> None:
    """While draining, anything held blocks the next read: a possible poison runs alone."""
    assert POLICY.is_full(held, draining_own_pending=True) is full


def test_room_is_the_free_slots_and_never_negative() -> None:
    assert [POLICY.room(held) for held in (0, 5, 8, 11)] == [8, 3, 0, 0]


def test_a_read_asks_for_at_most_read_count() -> None:
    assert [POLICY.read_size(room) for room in (1, 3, 8)] == [1, 3, 3]


@pytest.mark.parametrize("reading, held, flush", [
    (True, 0, False), (True, 7, False),  # more can arrive: batches may wait to fill
    (True, 8, True),  # the cap is reached: nothing more is read until answers go out
    (False, 0, True), (False, 3, True),  # reading stopped: nothing more will come
])
def test_flush_when_nothing_more_can_arrive(reading: bool, held: int, flush: bool) -> None:
    assert POLICY.should_flush(reading, held) is flush


@pytest.mark.parametrize("due, draining, claim", [
    (True, False, True), (False, False, False), (True, True, False), (False, True, False)])
def test_claim_only_when_a_sweep_is_due_and_not_draining(due: bool, draining: bool,
                                                        claim: bool) -> None:
    assert claims_first(due, draining) is claim


@pytest.mark.parametrize("blocking, idle, yields", [
    (False, 1, True), (False, 2, True), (False, 0, False), (True, 1, False), (True, 0, False)])
def test_a_busy_instance_yields_the_next_batch_to_an_idle_one(blocking: bool, idle: int,
                                                              yields: bool) -> None:
    assert yields_to_idle(blocking, idle) is yields


def test_the_xadd_time_is_read_from_the_entry_id() -> None:
    assert entry_time_ms("1700000000123-7") == 1_700_000_000_123


def test_an_arrival_is_never_later_than_its_read() -> None:
    """A producer's explicit id in the future (and every later id of its stream) arrives
    when it is read."""
    assert arrival_ms("1700000000123-7", 1_700_000_000_500.9) == 1_700_000_000_123
    assert arrival_ms("1800000000000-0", 1_700_000_000_500.9) == 1_700_000_000_500


def test_queue_waits_are_in_ms_to_the_microsecond_and_never_negative() -> None:
    waits = queue_waits_ms(1_000_250.4567, [1_000_000, 1_000_250, 1_000_300])
    assert waits == [250.457, 0.457, 0.0]


def test_end_to_end_times_are_seconds_from_the_xadd() -> None:
    assert end_to_end_s(2_000.0, [1_000, 1_500, 2_500]) == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("deadline, passed", [(None, False), (999, True), (1000, True),
                                              (1001, False)])
def test_a_deadline_has_passed_once_its_ms_has_come(deadline: int | None, passed: bool) -> None:
    assert is_past_deadline(deadline, now_ms=1000) is passed


def test_backoff_grows_to_its_cap_with_full_jitter() -> None:
    delays = list(itertools.islice(backoff_delays(0.05, 2.0, random.Random(1)), 12))
    ceilings = [min(2.0, 0.05 * 2**n) for n in range(12)]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert max(delays[8:]) > 0.5  # reached the cap's range, not stuck at the base
