"""bench/throughput/gpu_compare.py's pure part: the offline limit's batches, sorted by length under
both limits (the GPU run itself is `python -m bench.gpu_check`)."""

from __future__ import annotations

from bench.throughput.gpu_compare import length_sorted_batches, verdict
from worker.models.base import Prepared


def test_offline_batches_are_sorted_by_length_under_both_limits() -> None:
    items = [Prepared(length, None) for length in (9, 1, 5, 3, 7, 2)]
    batches = length_sorted_batches(items, max_rows=2, max_tokens=12)
    assert [[item.length for item in batch] for batch in batches] == [[1, 2], [3, 5], [7], [9]]
    assert length_sorted_batches([], 2, 12) == []


def test_a_goal_is_met_or_missed() -> None:
    assert verdict(1.6, 1.5) == "1.60x (goal >= 1.5x: met)"
    assert verdict(0.79, 0.8).endswith("MISSED)")
