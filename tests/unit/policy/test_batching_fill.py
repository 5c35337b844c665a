"""An unfilled batch absorbing other buckets when that costs less (pure policy, no Redis)."""

from __future__ import annotations

from producer.protocol import MSGPACK
from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.batching import Batcher, BatchLimits, Pending

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


def test_an_unfilled_batch_absorbs_a_bucket_when_the_padding_costs_less_than_a_batch() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), merge_tokens=10)
    add_in_order(batcher, 18, 15, 30)
    # [18] goes first; [15] adds 2 x 18 - 18 - 15 = 3 padded tokens and joins; [30] would add
    # 3 x 30 - 2 x 18 - 30 = 24, more than a batch costs, and runs on its own.
    assert lengths(batcher) == [15, 18]
    assert lengths(batcher) == [30]
    assert len(batcher) == 0


def test_buckets_are_absorbed_cheapest_first() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), merge_tokens=20)
    add_in_order(batcher, 18, 40, 24, 11)
    # From [18]: 24 adds 6, 11 adds 7, 40 adds 22. Then from [18, 24]: 11 adds 13, 40 adds 48.
    assert lengths(batcher) == [11, 18, 24]
    assert lengths(batcher) == [40]


def test_a_bucket_moves_whole_or_not_at_all() -> None:
    for merge_tokens, expected in ((29, [20]), (30, [10, 10, 10, 20])):
        batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), merge_tokens=merge_tokens)
        add_in_order(batcher, 20, 10, 10, 10)  # merging adds 4 x 20 - 20 - 3 x 10 = 30
        assert lengths(batcher) == expected


def test_absorbing_respects_the_request_and_token_caps() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(3, 10_000, 0.005), merge_tokens=1000)
    add_in_order(batcher, 20, 19, 12, 11)
    assert lengths(batcher) == [19, 20]  # the two of [11, 12] would make 4 > 3 requests
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 60, 0.005), merge_tokens=1000)
    add_in_order(batcher, 20, 12, 11, 7)
    # [7] adds the least and joins; [11, 12] would then make 4 x 20 = 80 > 60 padded tokens.
    assert lengths(batcher) == [7, 20]
    assert lengths(batcher) == [11, 12]


def test_merge_tokens_zero_keeps_buckets_apart() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(16, 10_000, 0.005), merge_tokens=0)
    add_in_order(batcher, 18, 15, 11)
    assert lengths(batcher) == [18]


def test_a_full_bucket_absorbs_nothing() -> None:
    batcher = Batcher(BOUNDARIES, BatchLimits(2, 10_000, 10.0), merge_tokens=1000)
    add_in_order(batcher, 18, 17, 15)
    assert lengths(batcher, now=0.0) == [17, 18]  # full by count, before max_wait
    assert len(batcher) == 1
