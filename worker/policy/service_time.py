"""A service-time model: how long a batch takes, learnt online, at a chosen percentile.

A batch of n requests padded to length L costs `fixed + per_token * n * L` (one forward pass
plus its padded tokens), fitted per bucket by recursive least squares with forgetting, so
the fit follows a device whose speed drifts. The mean is not enough for a p99 target: a
windowed quantile of observed ÷ predicted scales the prediction to cover the percentile.

Pure: times are passed in as milliseconds. Written by hand (a 2-parameter RLS is a few
lines; no library was worth a dependency for it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PRIOR_FIXED_MS = 1.0  # before any batch is seen: a cheap device, so nothing waits for long
MIN_OBSERVATIONS = 4  # a bucket's own fit is used once it has seen this many batches
RATIO_WINDOW = 400


@dataclass(slots=True)
class CostFit:
    """Recursive least squares for t = fixed + per_token * x, with exponential forgetting."""

    forgetting: float = 0.97
    fixed: float = PRIOR_FIXED_MS
    per_token: float = 0.0
    count: int = 0
    # the inverse information matrix, [[p00, p01], [p01, p11]]; large: the prior is weak
    p00: float = 1e4
    p01: float = 0.0
    p11: float = 1.0

    def predict(self, tokens: float) -> float:
        return max(0.0, self.fixed + self.per_token * tokens)

    def update(self, tokens: float, observed_ms: float) -> None:
        lam = self.forgetting
        # gain k = P·h / (lam + hᵀ·P·h), with h = (1, tokens)
        ph0 = self.p00 + self.p01 * tokens
        ph1 = self.p01 + self.p11 * tokens
        denominator = lam + ph0 + tokens * ph1
        k0, k1 = ph0 / denominator, ph1 / denominator
        error = observed_ms - (self.fixed + self.per_token * tokens)
        self.fixed += k0 * error
        self.per_token += k1 * error
        self.p00, self.p01, self.p11 = ((self.p00 - k0 * ph0) / lam, (self.p01 - k0 * ph1) / lam,
                                        (self.p11 - k1 * ph1) / lam)
        self.count += 1


@dataclass(slots=True)
class WindowQuantile:
    """The q-quantile of the last `size` values (nearest rank); with `expire`, only of those
    added since a given time."""

    q: float
    size: int = RATIO_WINDOW
    values: deque[float] = field(default_factory=deque)
    times: deque[float] = field(default_factory=deque)  # when each value was added
    _cached: float | None = None  # sorted once per change, not once per question

    def add(self, value: float, at_ms: float = 0.0) -> None:
        self.values.append(value)
        self.times.append(at_ms)
        if len(self.values) > self.size:
            self.values.popleft()
            self.times.popleft()
        self._cached = None

    def expire(self, before_ms: float) -> None:
        """Forget the values added before `before_ms`."""
        while self.times and self.times[0] < before_ms:
            self.values.popleft()
            self.times.popleft()
            self._cached = None

    def value(self, default: float) -> float:
        if not self.values:
            return default
        if self._cached is None:
            ordered = sorted(self.values)
            self._cached = ordered[min(len(ordered) - 1, int(self.q * len(ordered)))]
        return self._cached


class ServiceTimeModel:
    """Predicted batch time per bucket at the target percentile, in ms."""

    def __init__(self, buckets: int, percentile: float, forgetting: float = 0.97) -> None:
        self.overall = CostFit(forgetting)
        self.fits = [CostFit(forgetting) for _ in range(buckets)]
        self.ratio = WindowQuantile(percentile)

    def fit(self, bucket: int) -> CostFit:
        """The bucket's own fit once it has enough data, else the one over all buckets."""
        own = self.fits[bucket]
        return own if own.count >= MIN_OBSERVATIONS else self.overall

    def mean_ms(self, bucket: int, size: int, longest: int) -> float:
        return self.fit(bucket).predict(size * longest)

    def predict_ms(self, bucket: int, size: int, longest: int) -> float:
        """The time a batch takes at the percentile: the mean scaled by the ratio quantile."""
        return self.mean_ms(bucket, size, longest) * max(1.0, self.ratio.value(1.0))

    def observe(self, bucket: int, size: int, longest: int, observed_ms: float) -> None:
        predicted = self.mean_ms(bucket, size, longest)
        if predicted > 0 and self.overall.count >= MIN_OBSERVATIONS:
            self.ratio.add(observed_ms / predicted)
        tokens = size * longest
        self.overall.update(tokens, observed_ms)
        self.fits[bucket].update(tokens, observed_ms)
