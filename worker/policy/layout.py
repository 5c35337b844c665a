"""How a process spends its cores: how many model instances, each with how many threads.

On a CPU, single-threaded instances beat one instance on every core at the batch sizes a
latency-bound queue forms (measured: docs/deploy.md, bench/results/), so `instances =
"auto"` runs one per core for a model whose forward is safe to call from several threads.
On CUDA such a model runs two instances per device: a compute loop leaves the GPU idle while
it postprocesses one batch and launches the next, and the other instance's batch fills that
gap (issue 31: 35 % of the offline limit with one, 39 % with two, re-measured by
bench/gpu_check.py). Explicit numbers are kept as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"
CUDA_INSTANCES = 2  # per device, for a model that declares concurrent_forward


@dataclass(frozen=True, slots=True)
class Layout:
    instances: int
    threads: int  # torch intra-op threads (shared by the instances: torch's count is global)
    reason: str  # why this layout, for the serving log line and stats

    def describe(self) -> str:
        return f"{self.instances} instance(s) x {self.threads} thread(s)"


def choose_layout(instances: int | str, torch_threads: int, cores: int, on_cpu: bool,
                  concurrent_forward: bool) -> Layout:
    """`instances`: a number, or "auto"; `torch_threads` 0: the cores shared out; `cores`:
    the cores this process may use (its affinity and cgroup quota, over the processes)."""
    cores = max(1, cores)
    if instances != AUTO:
        count = int(instances)
        return Layout(count, torch_threads or max(1, cores // count), "as set")
    if not on_cpu and concurrent_forward:
        return Layout(CUDA_INSTANCES, torch_threads or cores,
                      f"{CUDA_INSTANCES} instances per device: one computes while the other "
                      "postprocesses")
    if not on_cpu:
        return Layout(1, torch_threads or cores, "one instance per device")
    if not concurrent_forward:
        return Layout(1, torch_threads or cores,
                      "the model does not declare concurrent_forward: one instance")
    return Layout(cores, torch_threads or 1, "one single-threaded instance per core")


def cores_from_quota(affinity: int, quota_us: int | None, period_us: int | None) -> int:
    """The cores a process may use: its affinity, capped by a cgroup CPU quota (rounded up,
    so a quota of 1.5 cores gives 2 threads rather than leaving half a core unused)."""
    if quota_us is None or not period_us or quota_us <= 0:
        return max(1, affinity)
    return max(1, min(affinity, math.ceil(quota_us / period_us)))


def share_cores(cores: int, processes: int) -> int:
    """Each of `processes` worker processes' share of the cores (never below one)."""
    return max(1, cores // max(1, processes))
