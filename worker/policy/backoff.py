"""Backoff policy for retries: how long to wait before the next attempt.

Pure: it yields delays and sleeps nowhere; the Redis retry helper and the supervisor's
restarts do the waiting.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(base: float = 0.05, cap: float = 2.0,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Capped exponential backoff with full jitter."""
    uniform = (rng or random).uniform
    delay = base
    while True:
        yield uniform(0, delay)
        delay = min(cap, delay * 2)
