"""The worker's decisions per 10 s window, as `--sample-metrics` records them: differences
between the /metrics snapshots at each window's ends (bench/latency/live/metrics.py)."""

from __future__ import annotations

from bench.latency.live.metrics import per_window

START = 1_000_000.0  # the wall-clock time the arrivals began


def snapshot(at_s: float, batches: int, requests: int, compute_s: float, margin_s: float,
             deadline: int) -> tuple[float, dict[str, float]]:
    return (START + at_s, {"redbatch_batch_size_count:": batches,
                           "redbatch_batch_size_sum:": requests,
                           "redbatch_compute_seconds_sum:": compute_s,
                           "redbatch_latency_margin_seconds:": margin_s,
                           "redbatch_latency_observed_seconds:": 0.2,
                           "redbatch_dispatches_total:deadline": deadline,
                           "redbatch_dispatches_total:full": 3})


def test_each_window_is_the_difference_of_the_snapshots_at_its_ends() -> None:
    snapshots = [snapshot(-0.5, 0, 0, 0.0, 0.0, 0), snapshot(5.0, 10, 15, 2.0, 0.0, 1),
                 snapshot(9.5, 20, 30, 5.0, 0.05, 4), snapshot(19.5, 60, 130, 14.5, 0.1, 9)]
    first, second = per_window(snapshots, START, windows=3)
    assert first == {"window": 0, "reasons": {"deadline": 4}, "per_batch": 1.5,
                     "busy": 0.5, "margin_ms": 50, "observed_ms": 200}
    assert second["reasons"] == {"deadline": 5}  # `full` never changed: left out
    assert second["per_batch"] == 2.5 and second["busy"] == 0.95 and second["margin_ms"] == 100


def test_a_window_with_no_snapshot_inside_is_left_out() -> None:
    snapshots = [snapshot(0.0, 0, 0, 0.0, 0.0, 0), snapshot(25.0, 10, 10, 1.0, 0.0, 0)]
    assert per_window(snapshots, START, windows=3) == [
        {"window": 2, "reasons": {}, "per_batch": 1.0, "busy": 0.04, "margin_ms": 0,
         "observed_ms": 200}]
