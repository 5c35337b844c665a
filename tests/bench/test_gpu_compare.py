"""bench/throughput/gpu_compare.py: its pure parts (the offline limit's batches, the verdict,
the worker's start-up lines), and the whole comparison on a CPU with a small corpus (the GPU
run itself is `python -m bench.gpu_check`)."""

from __future__ import annotations

import pytest
import torch

from bench.throughput.gpu_compare import compare, verdict
from bench.throughput.gpu_offline import length_sorted_batches
from bench.throughput.gpu_served import graphs_line, startup_events
from worker.execution.executor import cpu_bf16_support
from worker.models.base import Prepared


def test_offline_batches_are_sorted_by_length_under_both_limits() -> None:
    items = [Prepared(length, None) for length in (9, 1, 5, 3, 7, 2)]
    batches = length_sorted_batches(items, max_rows=2, max_tokens=12)
    assert [[item.length for item in batch] for batch in batches] == [[1, 2], [3, 5], [7], [9]]
    assert length_sorted_batches([], 2, 12) == []


def test_a_goal_is_met_or_missed() -> None:
    assert verdict(1.6, 1.5) == "1.60x (goal >= 1.5x: met)"
    assert verdict(0.79, 0.8).endswith("MISSED)")


def test_the_graphs_line_comes_from_the_workers_log_and_its_replay_counter() -> None:
    log = ['noise', '{"event": "cuda_graphs.captured", "shapes": 141, "seconds": 16.3}',
           '{"event": "worker.serving", "dtype": "bfloat16", "instances": 2}', '{broken']
    events = startup_events(log)
    assert events["worker.serving"]["dtype"] == "bfloat16"
    assert graphs_line(events, {"replayed": 45.0, "eager": 2.0}) == (
        "used: 141 shapes captured in 16.3 s, 45 batches replayed, 2 eager")
    assert graphs_line(events, {}) == "used: 141 shapes captured in 16.3 s"
    skipped = startup_events(['{"event": "cuda_graphs.skipped", "reason": "no CUDA device"}'])
    assert graphs_line(skipped, {}) == "not used (no CUDA device)"
    assert graphs_line({}, {}) == "not used (none captured)"


@pytest.mark.slow
def test_the_comparison_runs_on_a_cpu_with_the_worker_in_its_own_process() -> None:
    """Seconds: 48 texts, one round, no warm-up, no sentence-transformers."""
    texts = [f"Text {n} about batching." + " word" * (n % 40) for n in range(48)]
    said: list[str] = []
    threads = torch.get_num_threads()  # loading as the worker does sets the process's
    try:
        figures = compare(None, torch.device("cpu"), said.append, texts=texts, rounds=1,
                          repeat=2, with_st=False, processes=2, warmup=False)
    finally:
        torch.set_num_threads(threads)
    assert figures["redbatch"] > 0 and figures["offline"] > 0 and "st" not in figures
    assert figures["redbatch_processes"] > 0
    assert any(line.startswith("redbatch, 2 worker processes on the device") for line in said)
    served = next(line for line in said if line.startswith("redbatch, default settings"))
    auto = "bfloat16" if cpu_bf16_support() else "float32"  # dtype auto on this CPU
    assert f"dtype {auto}" in served and "96 requests a round" in served
    assert "CUDA graphs: not used" in "\n".join(said)
    assert any(line.startswith("redbatch offline, forward only") for line in said)
    assert any(line.startswith("redbatch / offline end-to-end limit") for line in said)
