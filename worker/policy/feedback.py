"""What the latency policy learns from the traffic as it goes: the arrival rate of each
bucket, and the safety margin steered by the observed percentile of end-to-end latency.

Pure: times in milliseconds are passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.policy.service_time import WindowQuantile

MARGIN_UP = 0.10  # of the target, per update while the observed percentile is over it
MARGIN_DOWN = 0.01  # of the target, per update while it is under MARGIN_CALM x the target
MARGIN_CALM = 0.8
MARGIN_MAX = 0.6  # of the target: beyond this the target itself is out of reach
MARGIN_UPDATE_MS = 250.0
LATENCY_WINDOW = 1000  # answers in the observed percentile's window, at most
LATENCY_WINDOW_MS = 10_000.0  # and none older than this
RATE_HALF_LIFE_MS = 1000.0


class ArrivalRate:
    """Arrivals per ms, an exponentially decaying count (pure: times passed in)."""

    def __init__(self, half_life_ms: float = RATE_HALF_LIFE_MS) -> None:
        self.half_life_ms = half_life_ms
        self.weight = 0.0
        self.last_ms: float | None = None

    def _decayed(self, now_ms: float) -> float:
        if self.last_ms is None:
            return 0.0
        return self.weight * 0.5 ** (max(0.0, now_ms - self.last_ms) / self.half_life_ms)

    def add(self, now_ms: float, count: int = 1) -> None:
        self.weight = self._decayed(now_ms) + count
        self.last_ms = now_ms

    def per_ms(self, now_ms: float) -> float:
        # a decaying count with half-life h sums to rate x h / ln 2
        return self._decayed(now_ms) * 0.6931 / self.half_life_ms


class SafetyMargin:
    """Milliseconds kept in hand below each deadline, steered by the observed percentile."""

    def __init__(self, target_ms: float, percentile: float) -> None:
        self.target_ms = target_ms
        self.ms = 0.0
        self.observed = WindowQuantile(percentile, LATENCY_WINDOW)
        self._updated_ms = 0.0

    def over_target(self) -> bool:
        """The observed percentile is over the target: the load or a slower device, more
        than the prediction, is what makes requests late."""
        return self.observed.value(0.0) > self.target_ms

    def observe(self, now_ms: float, latencies_ms: Sequence[float]) -> None:
        for latency in latencies_ms:
            self.observed.add(latency, now_ms)
        self.update(now_ms)

    def update(self, now_ms: float) -> None:
        """Steer the margin (at most once per MARGIN_UPDATE_MS). Answers older than
        LATENCY_WINDOW_MS leave the window, and with none left there is nothing to keep
        a margin for: so one raised by a burst cannot refuse every request for good, as
        it would while shedding, when nothing served means nothing new observed."""
        if now_ms - self._updated_ms < MARGIN_UPDATE_MS:
            return
        self._updated_ms = now_ms
        self.observed.expire(now_ms - LATENCY_WINDOW_MS)
        if not self.observed.values:
            self.ms = 0.0
            return
        observed = self.observed.value(0.0)
        if observed > self.target_ms:
            self.ms = min(MARGIN_MAX * self.target_ms, self.ms + MARGIN_UP * self.target_ms)
        elif observed < MARGIN_CALM * self.target_ms:
            self.ms = max(0.0, self.ms - MARGIN_DOWN * self.target_ms)
