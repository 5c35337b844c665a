"""The benchmark's pure parts: statistics, arrivals, corpus filtering, target checks."""

from __future__ import annotations

import math

import torch

from bench.common.corpus import paragraphs
from bench.common.load import poisson_offsets
from bench.common.stats import histogram, percentile
from bench.throughput.measure import Layout, layouts, offline_rate
from bench.throughput.report import targets
from tests.redis.single.test_instances import OverlapCountingEcho


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == 99
    assert math.isnan(percentile([], 50))


def test_histogram_subtracts_the_earlier_scrape_and_uncumulates() -> None:
    def bucket(le: str, bucket_label: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return ("h_bucket", frozenset({("le", le), ("bucket", bucket_label)}))

    before = {bucket("1.0", "0"): 1.0, bucket("2.0", "0"): 2.0}
    after = {bucket("1.0", "0"): 3.0, bucket("2.0", "0"): 7.0, bucket("1.0", "1"): 1.0,
             bucket("2.0", "1"): 1.0}
    assert histogram(before, after, "h") == {1.0: 3.0, 2.0: 3.0}


def test_poisson_offsets_are_seeded_increasing_and_near_the_rate() -> None:
    offsets = poisson_offsets(rate=200, duration_s=10, seed=1)
    assert offsets == poisson_offsets(rate=200, duration_s=10, seed=1)
    assert offsets == sorted(offsets) and offsets[-1] < 10
    assert 1800 < len(offsets) < 2200


def test_paragraphs_keep_prose_and_drop_code_and_doctests() -> None:
    doc = ("Return the sum of the values.\n\n    >>> add(1, 2)\n    3\n\n"
           "x = {1: [2, 3]}  # {}[]()\n\nSee also the\n   other  function here.")
    assert list(paragraphs(doc)) == ["Return the sum of the values.",
                                     "See also the other function here."]


def test_targets_compare_each_figure_with_its_bar() -> None:
    results = {
        "saturation": {"redbatch": {"ratio_to_offline": 0.95}, "fifo": {"bucketing_speedup": 1.2}},
        "overhead": {"worker_median": 25_000, "ratio": 0.4},
        "latency": {"settings": {"max_wait_ms": 5.0}, "levels": [
            {"load": 0.5, "e2e_ms": {"p99": 40.0}, "batch_compute_ms": {"p99": 20.0}}]},
        "scaling": {"processes": {1: {"factor": 1.0}, 2: {"factor": 1.9}, 4: {"factor": 3.0}}},
    }
    assert [t["met"] for t in targets(results)] == [True, False, True, False, True, True, False]


def test_the_default_layout_is_held_to_the_best_one() -> None:
    results = {
        "saturation": {"redbatch": {"ratio_to_offline": 0.95}, "fifo": {"bucketing_speedup": 2},
                       "defaults": {"ratio_to_best_layout": 0.85}},
        "overhead": {"worker_median": 25_000, "ratio": 0.6},
        "latency": {"settings": {"max_wait_ms": 5.0}, "levels": []},
        "scaling": {"processes": {}},
    }
    [default] = [t for t in targets(results) if "default settings" in t["target"]]
    assert default["met"] is False and default["bar"] == 0.9


def test_offline_layouts_cover_one_instance_and_one_per_core() -> None:
    assert layouts(1) == [Layout(1, 1)]
    assert layouts(2) == [Layout(1, 1), Layout(1, 2), Layout(2, 1)]
    assert layouts(8) == [Layout(1, 1), Layout(1, 8), Layout(8, 1)]


def test_offline_instances_share_the_batches_and_run_at_once() -> None:
    model = OverlapCountingEcho(delay_ms=30)
    default = torch.get_num_threads()
    try:
        assert offline_rate(model, [f"text {i}" for i in range(8)], 2, Layout(2, 1)) > 0
    finally:
        torch.set_num_threads(default)
    assert model.batches == 4 and model.most == 2
