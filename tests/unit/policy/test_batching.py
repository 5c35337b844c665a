"""The batching policy on its own: buckets, caps, readiness, ordering, deadlines."""

from __future__ import annotations

import pytest

from producer.protocol import MSGPACK
from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.batching import Batch, Batcher, BatchLimits, Pending, bucket_of, take_members

LIMITS = BatchLimits(max_batch_size=4, max_batch_tokens=1000, max_wait_s=0.1)
NOW_MS = 1_700_000_000_000


def pending(length: int, *, at: float = 0.0, priority: int = 0,
            deadline_ms: int | None = None, name: str = "") -> Pending:
    request = Request(name or f"len{length}", b"", MSGPACK, "reply", deadline_ms, priority)
    return Pending(f"0-{length}", request, Prepared(length, None), read_at=at)


def names(batch: Batch | None) -> list[str]:
    assert batch is not None
    return [p.request.id for p in batch.members]


@pytest.mark.parametrize("length, bucket", [(1, 0), (16, 0), (17, 1), (64, 2), (65, 3),
                                            (10_000, 3)])
def test_bucket_of_uses_inclusive_upper_boundaries(length: int, bucket: int) -> None:
    assert bucket_of(length, [16, 32, 64]) == bucket


def test_no_boundaries_is_one_fifo_bucket() -> None:
    assert bucket_of(5, []) == bucket_of(5000, []) == 0


def test_take_members_stops_at_the_request_cap() -> None:
    assert len(take_members([pending(1)] * 10, LIMITS)) == 4


def test_take_members_stops_at_the_padded_token_cap() -> None:
    limits = BatchLimits(32, max_batch_tokens=100, max_wait_s=0)
    chosen = take_members([pending(10), pending(30), pending(20), pending(40)], limits)
    assert [p.item.length for p in chosen] == [10, 30, 20]  # 3 x 30 = 90; 4 x 40 > 100


def test_an_input_above_the_token_cap_still_runs_alone() -> None:
    limits = BatchLimits(32, max_batch_tokens=100, max_wait_s=0)
    assert [p.item.length for p in take_members([pending(500), pending(1)], limits)] == [500]


def test_a_bucket_waits_for_max_wait_then_flushes_a_lone_request() -> None:
    batcher = Batcher([16], LIMITS)
    batcher.add(pending(5, at=0.0))
    assert batcher.next_batch(now=0.05, now_ms=NOW_MS) is None
    assert batcher.seconds_until_ready(0.05) == pytest.approx(0.05)
    assert names(batcher.next_batch(now=0.1, now_ms=NOW_MS)) == ["len5"]
    assert len(batcher) == 0 and batcher.seconds_until_ready(0.1) is None


def test_a_full_bucket_goes_without_waiting() -> None:
    batcher = Batcher([16], LIMITS)
    for _ in range(5):
        batcher.add(pending(5))
    batch = batcher.next_batch(now=0.0, now_ms=NOW_MS)
    assert batch is not None and len(batch.members) == 4 and len(batcher) == 1
    assert batcher.next_batch(now=0.0, now_ms=NOW_MS) is None  # the rest waits


def test_a_bucket_full_of_padded_tokens_goes_without_waiting() -> None:
    batcher = Batcher([], BatchLimits(32, max_batch_tokens=100, max_wait_s=1))
    batcher.add(pending(50, name="a"))
    assert batcher.next_batch(now=0.0, now_ms=NOW_MS) is None
    batcher.add(pending(50, name="b"))  # 2 x 50 reaches the 100-token cap
    assert names(batcher.next_batch(now=0.0, now_ms=NOW_MS)) == ["a", "b"]


def test_flush_dispatches_at_once() -> None:
    batcher = Batcher([16], LIMITS)
    batcher.add(pending(5))
    assert names(batcher.next_batch(now=0.0, now_ms=NOW_MS, flush=True)) == ["len5"]


def test_batches_never_mix_buckets_and_pad_to_their_longest() -> None:
    batcher = Batcher([16, 64], LIMITS)
    assert [batcher.add(pending(n)) for n in (3, 40, 12, 50, 100)] == [0, 1, 0, 1, 2]
    batches = [batcher.next_batch(now=1.0, now_ms=NOW_MS) for _ in range(3)]
    assert [(b.bucket, b.longest, b.padded_tokens, b.real_tokens)
            for b in batches if b] == [(0, 12, 24, 15), (1, 50, 100, 90), (2, 100, 100, 100)]


def test_the_bucket_holding_the_oldest_request_goes_first() -> None:
    batcher = Batcher([16], LIMITS)
    batcher.add(pending(50, at=1.0))
    batcher.add(pending(5, at=2.0))
    batcher.add(pending(6, at=3.0))
    assert names(batcher.next_batch(now=5.0, now_ms=NOW_MS)) == ["len50"]
    assert names(batcher.next_batch(now=5.0, now_ms=NOW_MS)) == ["len5", "len6"]


def test_an_old_request_is_not_starved_by_a_busy_bucket() -> None:
    batcher = Batcher([16], LIMITS)
    batcher.add(pending(50, at=0.0))
    for _ in range(4):  # a full batch of short requests keeps arriving
        batcher.add(pending(5, at=0.09))
    assert names(batcher.next_batch(now=0.1, now_ms=NOW_MS)) == ["len50"]


def test_higher_priority_first_then_arrival_order() -> None:
    batcher = Batcher([], BatchLimits(2, 1000, 0))
    for name, priority in [("a", 0), ("b", 5), ("c", 1), ("d", 5), ("e", 0)]:
        batcher.add(pending(1, priority=priority, name=name))
    order = [names(batcher.next_batch(now=0.0, now_ms=NOW_MS)) for _ in range(3)]
    assert order == [["b", "d"], ["c", "a"], ["e"]]


def test_priority_order_still_respects_the_token_cap() -> None:
    batcher = Batcher([], BatchLimits(4, 100, 0))
    batcher.add(pending(10, name="low"))
    batcher.add(pending(60, priority=1, name="big"))
    batcher.add(pending(50, priority=2, name="urgent"))
    assert names(batcher.next_batch(now=0.0, now_ms=NOW_MS)) == ["urgent"]  # 2 x 60 > 100
    assert names(batcher.next_batch(now=0.0, now_ms=NOW_MS)) == ["big"]
    assert batcher.buckets[0].longest == 10


def test_requests_past_their_deadline_are_set_apart_without_compute() -> None:
    batcher = Batcher([], LIMITS)
    batcher.add(pending(1, deadline_ms=NOW_MS - 1, name="late"))
    batcher.add(pending(1, deadline_ms=NOW_MS + 1000, name="alive"))
    batcher.add(pending(1, name="no-deadline"))
    batch = batcher.next_batch(now=1.0, now_ms=NOW_MS)
    assert names(batch) == ["alive", "no-deadline"]
    assert batch is not None and [p.request.id for p in batch.expired] == ["late"]


def test_a_batch_can_be_all_expired() -> None:
    batcher = Batcher([], LIMITS)
    batcher.add(pending(1, deadline_ms=NOW_MS))
    batch = batcher.next_batch(now=1.0, now_ms=NOW_MS)
    assert batch is not None and batch.members == [] and len(batch.expired) == 1
    assert batch.longest == 0 and batch.padded_tokens == 0
