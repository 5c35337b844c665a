"""Summaries of repeated measurements: medians, percentiles, histograms from /metrics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import numpy

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; NaN for no values."""
    return float(numpy.percentile(values, q)) if len(values) else math.nan


def percentiles(values: Sequence[float], qs: Iterable[float] = (50, 95, 99)) -> dict[str, float]:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def histogram(before: Samples, after: Samples, name: str) -> dict[float, float]:
    """Per-bin counts of a Prometheus histogram between two scrapes, summed over labels."""
    cumulative: dict[float, float] = {}
    for (sample, labels), value in after.items():
        if sample != f"{name}_bucket":
            continue
        le = float(dict(labels)["le"])
        cumulative[le] = cumulative.get(le, 0.0) + value - before.get((sample, labels), 0.0)
    counts: dict[float, float] = {}
    previous = 0.0
    for le in sorted(cumulative):
        counts[le] = cumulative[le] - previous
        previous = cumulative[le]
    return counts
