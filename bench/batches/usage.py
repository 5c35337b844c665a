"""What the processes of a bench.batches run used: peak RSS and CPU seconds (sampled), and
the worker's batches (from its /metrics)."""

from __future__ import annotations

import threading

import psutil

from bench.common.stats import Samples


class PeakRss:
    """The largest RSS of some processes (and their children), sampled in a thread, and
    the CPU seconds each used meanwhile (where the batch path's overhead goes)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak = pids, dict.fromkeys(pids, 0)
        self.cpu = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                try:
                    root = psutil.Process(pid)
                    family = [root, *root.children(True)]
                    rss = sum(p.memory_info().rss for p in family)
                    cpu = sum(sum(p.cpu_times()[:2]) for p in family)
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak[name], rss)
                self.cpu[name] = cpu

    def __enter__(self) -> PeakRss:
        self._sample_once()
        self.started = dict(self.cpu)
        self._thread.start()
        return self

    def _sample_once(self) -> None:
        for name, pid in self.pids.items():
            try:
                root = psutil.Process(pid)
                self.cpu[name] = sum(sum(p.cpu_times()[:2])
                                     for p in [root, *root.children(True)])
            except psutil.Error:
                continue

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) each process used while sampled."""
        return {name: round(self.cpu[name] - self.started.get(name, 0.0), 2)
                for name in self.pids}

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample_once()

    def mib(self) -> dict[str, float]:
        return {name: round(rss / 2**20, 1) for name, rss in self.peak.items()}


def batch_shape(before: Samples, after: Samples) -> dict[str, float]:
    """The worker's batches meanwhile: how many, their mean size and padding efficiency
    (smaller or more padded batches are where a path's extra worker CPU goes)."""
    def grown(name: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)
    batches, rows = grown("redbatch_batch_size_count"), grown("redbatch_batch_size_sum")
    padded = grown("redbatch_padded_tokens_total")
    return {"batches": batches, "mean_rows": rows / batches if batches else 0.0,
            "padding_efficiency": grown("redbatch_real_tokens_total") / padded if padded
            else 1.0}
