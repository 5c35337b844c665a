"""Where the benchmarks find the repository's sample texts and write their results.

Each benchmark family writes under its own folder of `bench/results/`, named as its package.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SENTENCES = REPO_ROOT / "examples" / "sentences.txt"
RESULTS = REPO_ROOT / "bench" / "results"


def results_dir(family: str) -> Path:
    """The results folder of one benchmark family (`throughput`, `latency`, ...)."""
    return RESULTS / family
