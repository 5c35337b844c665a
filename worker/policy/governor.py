"""The memory-watermark governor: per-bucket batch caps that shrink before OOM and grow back.

Pure policy, like batching.py: memory readings and times are passed in, so every rule is
unit-tested without a device. The shape is AIMD, as in TCP congestion control: above the
high watermark every bucket's cap is cut multiplicatively; after a calm spell below the low
watermark the caps grow back additively. Each bucket also remembers the largest batch that
ran and the smallest that ran out of memory, and never grows to that failed size again
until a long calm spell suggests the pressure that caused it has gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from worker.policy.batching import BatchLimits

if TYPE_CHECKING:
    from worker.settings import Settings


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """Memory as the governor sees it, in bytes.

    `used` is what must stay under `limit`: on CUDA, memory held by others plus this
    process's peak in live tensors during the last batch; on CPU, the process RSS.
    """

    used: int
    limit: int
    reserved: int = 0  # held by the CUDA caching allocator
    allocated: int = 0  # in live tensors

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit > 0 else 0.0

    @property
    def cached(self) -> int:
        """Reserved but unused: cache that fragments and that other processes cannot use."""
        return max(0, self.reserved - self.allocated)


@dataclass(frozen=True, slots=True)
class Cap:
    """The most requests and padded tokens (n x longest) one batch of a bucket may hold."""

    requests: int
    tokens: int


@dataclass(slots=True)
class Ceiling:
    """What a bucket has learnt: the largest batch that ran, the smallest that ran out."""

    largest_ok: int = 0  # padded tokens
    smallest_failed: int | None = None  # padded tokens
    failed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class GovernorPolicy:
    high_watermark: float = 0.90
    low_watermark: float = 0.75
    cut_factor: float = 0.5  # multiplicative decrease above the high watermark
    grow_fraction: float = 0.125  # additive increase per step, as a fraction of the base cap
    grow_after_s: float = 5.0  # calm time below the low watermark before each growth step
    cut_after_s: float = 1.0  # after a cut, the next waits this long: batches formed under the
    # old caps are still running, and memory takes a moment to come back
    forgive_after_s: float = 300.0  # calm time after which a failed size may be tried again
    fragmentation_fraction: float = 0.10  # idle cached memory, as a fraction of the limit


def kv_cache_budget(configured_bytes: int, reading: MemoryReading,
                    high_watermark: float) -> int:
    """A generative model's KV pool: the configured bytes, lowered so that the memory in
    use once the model is loaded plus the pool stays under the high watermark (the pool is
    allocated once and never grows, so this one reading is the whole rule)."""
    room = int(high_watermark * reading.limit) - reading.used
    return max(0, min(configured_bytes, room))


def policy_from_settings(settings: Settings) -> GovernorPolicy:
    return GovernorPolicy(high_watermark=settings.memory_high_watermark,
                          low_watermark=settings.memory_low_watermark,
                          grow_after_s=settings.governor_grow_after_s,
                          cut_after_s=settings.governor_cut_after_s,
                          forgive_after_s=settings.governor_forgive_after_s)


class Governor:
    """Batch caps per bucket, driven by memory readings and out-of-memory failures."""

    def __init__(self, limits: BatchLimits, buckets: int, policy: GovernorPolicy | None = None,
                 calibrated: Mapping[int, int] | None = None) -> None:
        """`calibrated` maps a bucket index to its measured best batch size (requests)."""
        self.policy = policy or GovernorPolicy()
        self._template = limits
        sizes = calibrated or {}
        self.base = [Cap(min(limits.max_batch_size, sizes.get(i, limits.max_batch_size)),
                         limits.max_batch_tokens) for i in range(buckets)]
        self.caps = list(self.base)
        self.ceilings = [Ceiling() for _ in range(buckets)]
        self._limits = [self._as_limits(cap) for cap in self.caps]
        self._calm_since: float | None = None
        self._last_change = -math.inf
        self._last_cut = -math.inf

    def limits(self, bucket: int) -> BatchLimits:
        """The Batcher's limits for `bucket` right now (its caps provider)."""
        return self._limits[bucket]

    def observe(self, bucket: int, padded_tokens: int, reading: MemoryReading,
                now: float) -> bool:
        """A batch ran; react to the memory it left. Returns whether any cap changed."""
        ceiling = self.ceilings[bucket]
        ceiling.largest_ok = max(ceiling.largest_ok, padded_tokens)
        if ceiling.smallest_failed is not None and padded_tokens >= ceiling.smallest_failed:
            ceiling.smallest_failed = None  # that failure was transient: the size runs now
        policy = self.policy
        if reading.fraction >= policy.high_watermark:
            self._calm_since = None
            if now - self._last_cut < policy.cut_after_s:
                return False
            self._last_cut = now
            return self._set_all(self._cut, now)
        if reading.fraction > policy.low_watermark:
            self._calm_since = None  # between the watermarks: hold
            return False
        if self._calm_since is None:
            self._calm_since = now
        if (now - max(self._calm_since, self._last_change) < policy.grow_after_s
                or self.caps == self.base):  # nothing to grow back (the usual case)
            return False
        self._forgive(now)
        return self._set_all(self._grow, now)

    def on_out_of_memory(self, bucket: int, requests: int, padded_tokens: int,
                         now: float) -> None:
        """A batch ran out of memory: remember its size and halve the bucket's cap below it."""
        ceiling = self.ceilings[bucket]
        if ceiling.smallest_failed is None or padded_tokens < ceiling.smallest_failed:
            ceiling.smallest_failed = padded_tokens
        ceiling.failed_at = now
        cap = self.caps[bucket]
        self._set(bucket, Cap(max(1, min(cap.requests, requests // 2)),
                              max(1, min(cap.tokens, padded_tokens // 2))), now)
        self._calm_since = None

    def should_release_cache(self, reading: MemoryReading) -> bool:
        """Fragmentation guard: is so much cached but unused that it should go back?"""
        return reading.cached > self.policy.fragmentation_fraction * reading.limit

    # --- the two moves --------------------------------------------------------------------------

    def _cut(self, bucket: int) -> Cap:
        cap, factor = self.caps[bucket], self.policy.cut_factor
        return Cap(max(1, int(cap.requests * factor)), max(1, int(cap.tokens * factor)))

    def _grow(self, bucket: int) -> Cap:
        cap, base = self.caps[bucket], self.base[bucket]
        step = self.policy.grow_fraction
        tokens_ceiling = base.tokens
        failed = self.ceilings[bucket].smallest_failed
        if failed is not None:
            tokens_ceiling = min(tokens_ceiling, max(1, failed - 1))
        requests = min(base.requests, cap.requests + max(1, math.ceil(base.requests * step)))
        tokens = min(tokens_ceiling, cap.tokens + max(1, math.ceil(base.tokens * step)))
        return Cap(max(cap.requests, requests), max(cap.tokens, tokens))  # growing never cuts

    def _forgive(self, now: float) -> None:
        for ceiling in self.ceilings:
            if (ceiling.smallest_failed is not None
                    and now - ceiling.failed_at >= self.policy.forgive_after_s):
                ceiling.smallest_failed = None

    def _set_all(self, move: Callable[[int], Cap], now: float) -> bool:
        changed = [self._set(bucket, move(bucket), now) for bucket in range(len(self.caps))]
        return any(changed)

    def _set(self, bucket: int, cap: Cap, now: float) -> bool:
        if cap == self.caps[bucket]:
            return False
        self.caps[bucket] = cap
        self._limits[bucket] = self._as_limits(cap)
        self._last_change = now
        return True

    def _as_limits(self, cap: Cap) -> BatchLimits:
        return replace(self._template, max_batch_size=cap.requests, max_batch_tokens=cap.tokens)
