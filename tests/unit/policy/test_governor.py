"""The governor's policy with injected memory readings: shrink, hold, grow, ceilings."""

from __future__ import annotations

import pytest

from producer.request_entry import Request
from worker.models.base import Prepared
from worker.policy.batching import Batcher, BatchLimits, Pending
from worker.policy.governor import Cap, Governor, GovernorPolicy, MemoryReading, kv_cache_budget
from worker.settings import SettingsError, load_settings

LIMITS = BatchLimits(max_batch_size=32, max_batch_tokens=8192, max_wait_s=0.005)
POLICY = GovernorPolicy(high_watermark=0.9, low_watermark=0.75, cut_factor=0.5,
                        grow_fraction=0.125, grow_after_s=5.0, forgive_after_s=60.0)
HIGH = MemoryReading(used=95, limit=100)
MIDDLE = MemoryReading(used=80, limit=100)
LOW = MemoryReading(used=10, limit=100)


def governor(buckets: int = 2, calibrated: dict[int, int] | None = None) -> Governor:
    return Governor(LIMITS, buckets, POLICY, calibrated)


def test_caps_start_at_the_settings_or_the_calibrated_size() -> None:
    gov = governor(3, calibrated={1: 8, 2: 64})
    assert gov.caps == [Cap(32, 8192), Cap(8, 8192), Cap(32, 8192)]  # never above the setting
    assert gov.limits(1) == BatchLimits(8, 8192, 0.005)


def test_above_the_high_watermark_every_bucket_is_cut_in_half() -> None:
    gov = governor()
    assert gov.observe(0, 1000, HIGH, now=0.0)
    assert gov.caps == [Cap(16, 4096), Cap(16, 4096)]
    gov.observe(0, 1000, HIGH, now=1.0)
    assert gov.caps[1] == Cap(8, 2048)
    assert gov.limits(1).max_batch_size == 8


def test_a_cut_is_given_time_to_work_before_the_next() -> None:
    """Batches formed under the old caps still run after a cut: they must not cut again."""
    gov = governor()
    gov.observe(0, 1000, HIGH, now=0.0)
    for now in (0.1, 0.5, 0.99):
        assert not gov.observe(0, 1000, HIGH, now=now)
    assert gov.caps == [Cap(16, 4096), Cap(16, 4096)]
    assert gov.observe(0, 1000, HIGH, now=1.0)
    assert gov.caps == [Cap(8, 2048), Cap(8, 2048)]


def test_caps_never_fall_below_one() -> None:
    gov = governor()
    for step in range(20):
        gov.observe(0, 1, HIGH, now=float(step))
    assert gov.caps == [Cap(1, 1), Cap(1, 1)]


def test_between_the_watermarks_caps_hold_and_the_calm_clock_restarts() -> None:
    gov = governor()
    gov.observe(0, 100, HIGH, now=0.0)
    cut = list(gov.caps)
    assert not gov.observe(0, 100, LOW, now=1.0)  # calm starts
    assert not gov.observe(0, 100, MIDDLE, now=10.0)  # hold, and calm is broken
    assert gov.caps == cut
    assert not gov.observe(0, 100, LOW, now=11.0)  # calm starts again
    assert not gov.observe(0, 100, LOW, now=15.9)
    assert gov.observe(0, 100, LOW, now=16.0)


def test_below_the_low_watermark_for_a_while_caps_grow_additively_up_to_the_base() -> None:
    gov = governor()
    gov.observe(0, 100, HIGH, now=-1.0)
    gov.observe(0, 100, HIGH, now=0.0)
    assert gov.caps[0] == Cap(8, 2048)
    gov.observe(0, 100, LOW, now=1.0)
    assert gov.caps[0] == Cap(8, 2048)  # not calm for long enough yet
    assert gov.observe(0, 100, LOW, now=6.0)
    assert gov.caps[0] == Cap(12, 3072)  # + 1/8 of the base: 4 requests, 1024 tokens
    assert not gov.observe(0, 100, LOW, now=7.0)  # one step per grow_after_s
    for step in range(2, 10):
        gov.observe(0, 100, LOW, now=1.0 + 5 * step)
    assert gov.caps == [Cap(32, 8192), Cap(32, 8192)]


def test_out_of_memory_halves_the_bucket_below_the_failed_size_and_remembers_it() -> None:
    gov = governor()
    gov.on_out_of_memory(1, requests=20, padded_tokens=2000, now=0.0)
    assert gov.caps == [Cap(32, 8192), Cap(10, 1000)]  # only that bucket
    assert gov.ceilings[1].smallest_failed == 2000
    gov.on_out_of_memory(1, requests=10, padded_tokens=1000, now=0.1)
    assert gov.caps[1] == Cap(5, 500)
    assert gov.ceilings[1].smallest_failed == 1000
    gov.on_out_of_memory(1, requests=1, padded_tokens=700, now=0.2)
    assert gov.caps[1].requests == 1


def test_growth_stops_below_the_smallest_failed_size_until_it_is_forgiven() -> None:
    gov = governor(1)
    gov.observe(0, 400, LOW, now=0.0)
    gov.on_out_of_memory(0, requests=16, padded_tokens=2000, now=0.0)
    now = 0.0
    for _ in range(10):
        now += 5.0
        gov.observe(0, 400, LOW, now=now)
    assert gov.caps[0] == Cap(32, 1999)
    assert gov.ceilings[0].largest_ok == 400
    now = 60.0
    gov.observe(0, 400, LOW, now=now)  # a long calm: the failure may have been transient
    assert gov.ceilings[0].smallest_failed is None
    assert gov.caps[0].tokens > 1999


def test_a_batch_that_runs_at_the_failed_size_clears_the_ceiling() -> None:
    gov = governor(1)
    gov.on_out_of_memory(0, requests=16, padded_tokens=2000, now=0.0)
    gov.observe(0, 2000, MIDDLE, now=1.0)
    assert gov.ceilings[0].smallest_failed is None
    assert gov.ceilings[0].largest_ok == 2000


def test_fragmentation_guard_releases_a_large_idle_cache_only() -> None:
    gov = governor()
    assert not gov.should_release_cache(MemoryReading(50, 100, reserved=40, allocated=35))
    assert gov.should_release_cache(MemoryReading(50, 100, reserved=40, allocated=20))
    assert not gov.should_release_cache(MemoryReading(50, 100))  # CPU: nothing cached


def pending(length: int) -> Pending:
    request = Request(id=f"r{length}", reply_to="reply", payload=b"", content_type="json")
    return Pending("1-0", request, Prepared(length, None), read_at=0.0)


def test_the_batcher_takes_each_bucket_cap_from_the_governor() -> None:
    gov = governor(2)
    batcher = Batcher([16], LIMITS, caps=gov.limits)
    for _ in range(20):
        batcher.add(pending(10))
    gov.on_out_of_memory(0, requests=8, padded_tokens=80, now=0.0)  # cap: 4 requests, 40 tokens
    batch = batcher.next_batch(now=1.0, now_ms=0)
    assert batch is not None and len(batch.members) == 4
    gov.observe(0, 40, LOW, now=1.0)
    gov.observe(0, 40, LOW, now=7.0)  # grows to 8 requests, but the token cap is 79 now
    batch = batcher.next_batch(now=8.0, now_ms=0)
    assert batch is not None and len(batch.members) == 7


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(SettingsError, match="memory_low_watermark"):
        load_settings(None, memory_low_watermark=0.9, memory_high_watermark=0.8)


def test_the_kv_cache_budget_fits_under_the_high_watermark() -> None:
    reading = MemoryReading(used=600 << 20, limit=1000 << 20)
    assert kv_cache_budget(256 << 20, reading, 0.9) == 256 << 20  # room: 300 MiB
    assert kv_cache_budget(512 << 20, reading, 0.9) == 300 << 20
    assert kv_cache_budget(512 << 20, MemoryReading(used=950 << 20, limit=1000 << 20),
                           0.9) == 0
