"""A description of the machine and software a benchmark ran on, for the report."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import psutil
import torch

from worker.streams.server import server_binary


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: the CPU flags that decide how fast bf16 and int8 matmuls run (AMX tiles, AVX-512 BF16/VNNI)
MATRIX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni",
                "avx_vnni")


def cpu_flags() -> list[str]:
    """Which of MATRIX_FLAGS /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return [flag for flag in MATRIX_FLAGS if flag in present]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def command_output(*command: str) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def describe_machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpus": usable_cpus(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(x, 2) for x in psutil.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "redis_server": command_output(str(server_binary()), "--version"),
        "git_commit": command_output("git", "-C", str(Path(__file__).parent), "rev-parse",
                                     "--short", "HEAD"),
    }


def machine_slug(machine: dict[str, Any]) -> str:
    """A file-name-friendly machine label, e.g. `2cpu-amd-epyc`."""
    cpu = re.sub(r"[^a-z0-9]+", "-", machine["cpu"].lower()).strip("-")
    return f"{machine['cpus']}cpu-{cpu}"[:48]
