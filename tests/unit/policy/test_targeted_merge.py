"""Under a latency target a batch absorbs other whole buckets, as the static batcher does
when one forward pass costs less than two, but only within its members' slack."""

from __future__ import annotations

from producer.protocol import MSGPACK
from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.batching import Batcher, BatchLimits, Pending
from worker.policy.latency import LatencyPolicy
from worker.policy.targeted import TargetedDispatch

FIXED_MS, PER_TOKEN_MS = 10.0, 0.1  # merging saves a forward pass: 100 padded tokens


def pending(name: str, length: int, at_ms: int, deadline_ms: int | None = None) -> Pending:
    request = Request(name, b"", MSGPACK, "reply", deadline_ms)
    return Pending(f"{at_ms}-0", request, Prepared(length, None), read_at=0.0)


def trained_policy() -> LatencyPolicy:
    policy = LatencyPolicy(100.0, 0.99, buckets=3)
    for bucket in range(3):
        for size, longest in [(1, 4), (4, 6), (16, 12), (32, 8)] * 5:
            policy.model.observe(bucket, size, longest,
                                 FIXED_MS + PER_TOKEN_MS * size * longest)
    return policy


def targeted_batcher(merge_tokens: int = 100, policy: LatencyPolicy | None = None) -> Batcher:
    return Batcher([4, 8], BatchLimits(32, 10_000, 0.0), merge_tokens=merge_tokens,
                   targeted=TargetedDispatch(policy or trained_policy()))


def ids(batch_members: list[Pending]) -> list[str]:
    return [p.request.id for p in batch_members]


def test_a_batch_absorbs_a_neighbouring_bucket_within_its_slack() -> None:
    batcher = targeted_batcher()
    for name, length in [("a", 4), ("b", 3), ("c", 6), ("d", 7)]:
        batcher.add(pending(name, length, 1000))
    batch = batcher.next_batch(0.0, 1001)
    assert batch is not None and batch.bucket == 0
    assert ids(batch.members) == ["a", "b", "c", "d"] and batch.longest == 7
    assert len(batcher) == 0


def test_no_merge_that_would_cost_the_earliest_deadline() -> None:
    batcher = targeted_batcher()
    # alone, a and b take 10 + 0.1 x 2 x 4 = 10.8 ms; with c and d, 12.8 ms
    for name in ("a", "b"):
        batcher.add(pending(name, 4, 1000, deadline_ms=1001 + 12))
    for name in ("c", "d"):
        batcher.add(pending(name, 7, 1000))
    batch = batcher.next_batch(0.0, 1001)
    assert batch is not None and ids(batch.members) == ["a", "b"]
    assert ids(batcher.buckets[1].items) == ["c", "d"]


def test_no_merge_beyond_merge_tokens_even_with_slack() -> None:
    batcher = targeted_batcher(merge_tokens=2)  # 4 x 7 - 2 x 4 - 2 x 7 = 6 tokens added
    for name, length in [("a", 4), ("b", 4), ("c", 7), ("d", 7)]:
        batcher.add(pending(name, length, 1000))
    batch = batcher.next_batch(0.0, 1001)
    assert batch is not None and ids(batch.members) == ["a", "b"]


def test_while_over_the_target_it_merges_as_the_static_batcher_does() -> None:
    """Behind its target the device needs the forward pass a merge saves, slack or not."""
    policy = trained_policy()
    policy.answered(900, [150.0] * 50)  # the window's p99 is over the 100 ms target
    assert policy.margin.over_target()
    batcher = targeted_batcher(policy=policy)
    for name in ("a", "b"):
        batcher.add(pending(name, 4, 1000, deadline_ms=1001 + 12))
    for name in ("c", "d"):
        batcher.add(pending(name, 7, 1000))
    batch = batcher.next_batch(0.0, 1001)
    assert batch is not None and ids(batch.members) == ["a", "b", "c", "d"]
