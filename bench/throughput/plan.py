"""How big each benchmark run is: full (the report), quick (a minute or two), smoke (CI)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    name: str
    corpus_size: int  # texts
    corpus_files: int | None  # stdlib files read (None: all)
    repeats: int  # of each side-by-side measurement; medians are taken over these
    batch_sizes: tuple[int, ...]  # tried offline with 1 and all torch threads; the best
    selection_texts: int  # of the corpus, for that choice
    loads: tuple[float, ...]  # open-loop arrival rates, as fractions of saturation
    latency_s: float  # seconds of arrivals per load level
    echo_requests: int  # for the overhead measurement
    scaling_processes: tuple[int, ...]
    scaling_requests: int  # per process: the queue grows with the process count
    delay_ms: float = 20.0  # echo's stand-in for device time when scaling
    warmup: int = 64  # requests through each worker before timing
    overhead_repeats: int = 5  # the echo measurement takes seconds: more repeats, steadier


PLANS = {
    "full": Plan("full", corpus_size=800, corpus_files=None, repeats=3, batch_sizes=(16, 32),
                 selection_texts=300, loads=(0.25, 0.5, 0.75), latency_s=30.0,
                 echo_requests=50_000, scaling_processes=(1, 2, 4), scaling_requests=2400),
    "quick": Plan("quick", corpus_size=400, corpus_files=None, repeats=2, batch_sizes=(16, 32),
                  selection_texts=200, loads=(0.25, 0.5, 0.75), latency_s=5.0,
                  echo_requests=20_000, scaling_processes=(1, 2, 4), scaling_requests=1200),
    "smoke": Plan("smoke", corpus_size=60, corpus_files=20, repeats=1, batch_sizes=(8,),
                  selection_texts=60, loads=(0.5,), latency_s=0.5, echo_requests=500,
                  scaling_processes=(1, 2), scaling_requests=64, delay_ms=2.0, warmup=8,
                  overhead_repeats=1),
}
