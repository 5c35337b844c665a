"""CPU of the processes in a probe run (`bench/latency/live/probe.py`): seconds used, read from
/proc, and an optional py-spy profile of the worker's threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling the worker's threads (not pausing it) for the run."""
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                             str(pid), "--duration", str(int(seconds)), "--rate", "100",
                             "--format", "raw", "--threads", "--nonblocking", "--output",
                             str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarise_profile(path: Path, top: int = 25) -> None:
    """Samples per thread, and the functions that hold them (self and total)."""
    threads: dict[str, int] = {}
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames, count = stack.split(";"), int(count_text)
        threads[frames[0]] = threads.get(frames[0], 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames[1:]):
            total[frame] = total.get(frame, 0) + count
    print("py-spy samples per thread (100 Hz, active only):", threads)
    for title, table in (("self", own), ("total", total)):
        print(f"top {title}:")
        for frame, count in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {count:6d} {frame}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
