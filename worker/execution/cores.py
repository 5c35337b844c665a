"""Reading the cores this process may use: its CPU affinity and its cgroup CPU quota.

torch's default thread count and os.cpu_count() see the machine; a container limited by
`--cpus` or a Kubernetes CPU limit gets a quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_*`), and
`taskset` or a cpuset gives an affinity. The policy (policy/layout.py) combines them.
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.policy.layout import cores_from_quota

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def affinity_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(v2: Path = CGROUP_V2_CPU_MAX, v1_quota: Path = CGROUP_V1_QUOTA,
                     v1_period: Path = CGROUP_V1_PERIOD) -> tuple[int | None, int | None]:
    """(quota µs, period µs) of this cgroup, or (None, None) when unlimited or unknown."""
    try:
        quota, _, period = v2.read_text().strip().partition(" ")
        return (None, None) if quota == "max" else (int(quota), int(period or 100_000))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(v1_quota.read_text())
        return (None, None) if quota_us < 0 else (quota_us, int(v1_period.read_text()))
    except (OSError, ValueError):
        return None, None


def available_cores() -> int:
    """The cores this process may use: its affinity, capped by its cgroup CPU quota."""
    return cores_from_quota(affinity_cores(), *cgroup_cpu_quota())
