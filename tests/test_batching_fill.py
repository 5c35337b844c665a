"""Topping up an unfilled batch from nearby buckets (pure policy, no Redis)."""

from __future__ import annotations

from producer.protocol import MSGPACK, Request
from worker.batching import Batcher, BatchLimits, Pending
from worker.models.base import Prepared

BOUNDARIES = [8, 10, 12, 16, 20, 32]
NOW_MS = 1_700_000_000_000


def pending(length: int, at: float = 0.0) -> Pending:
    request = Request(f"id{length}-{at}", b"", MSGPACK, "reply")
    return Pending(f"0-{length}", request, Prepared(length, None), read_at=at)


def add_in_order(batcher: Batcher, *lengths: int) -> None:
    """Oldest first: the first length was read first."""
    for position, length in enumerate(lengths):
        batcher.add(pending(length, at=position / 1000))


def lengths(batcher: Batcher, now: float = 1.0) -> list[int]:
    batch = batcher.next_batch(now, NOW_MS)
    assert batch is not None
    return sorted(p.item.length for p in batch.members)


def test_an_aged_batch_takes_shorter_requests_down_to_the_ratio() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), fill_ratio=0.5)
    add_in_order(batcher, 18, 15, 11, 9, 7, 30)
    # The oldest bucket (18: 16 < 18 <= 20) goes; 15, 11 and 9 are >= 9 = 18 x 0.5; 7 is not;
    # 30 is longer and waits for its own turn.
    assert lengths(batcher) == [9, 11, 15, 18]
    assert len(batcher) == 2
    assert lengths(batcher) == [7]  # the oldest of the two left
    assert lengths(batcher) == [30]
    assert len(batcher) == 0


def test_longer_requests_join_while_the_shortest_stays_within_the_ratio() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), fill_ratio=0.5)
    add_in_order(batcher, 18, 30, 24, 40)
    # 30 and 24 keep 18 >= half the longest; 40 would not (18 < 20) and waits.
    assert lengths(batcher) == [18, 24, 30]
    assert lengths(batcher) == [40]


def test_top_up_respects_the_request_and_token_caps() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(3, 10_000, 0.005), fill_ratio=0.5)
    add_in_order(batcher, 20, 19, 12, 11, 10)
    assert lengths(batcher) == [12, 19, 20]  # request cap 3: the oldest shorter one joins
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 60, 0.005), fill_ratio=0.5)
    add_in_order(batcher, 20, 12, 11, 10)
    assert lengths(batcher) == [11, 12, 20]  # 3 x 20 = 60 padded tokens at most


def test_ratio_one_keeps_buckets_apart() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), fill_ratio=1.0)
    add_in_order(batcher, 18, 15, 11)
    assert lengths(batcher) == [18]


def test_a_full_bucket_is_not_topped_up() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(2, 10_000, 10.0), fill_ratio=0.5)
    add_in_order(batcher, 18, 17, 15)
    assert lengths(batcher, now=0.0) == [17, 18]  # full by count, before max_wait
    assert len(batcher) == 1
