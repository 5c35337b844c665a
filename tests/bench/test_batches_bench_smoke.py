"""`python -m bench.batches` on a short input: its rig (an embedded Redis, a minilm worker
process, a gateway) starts, both paths answer every line and the latency run measures.
About 25 s (three process starts and a model load), so that a change to a flag, a default
or the rig under the benchmark fails here and not in the next figures' run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common.processes import REPO_ROOT


def test_the_batch_benchmark_runs_both_paths_and_the_latency_beside_a_batch(tmp_path: Path
                                                                            ) -> None:
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "bench.batches", "--lines", "40", "--repeats", "1",
                    "--online-s", "1", "--capacity-s", "1", "--latency-rounds", "1",
                    "--out", str(out)],
                   cwd=REPO_ROOT, check=True, timeout=240, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    report = json.loads(out.read_text())
    assert set(report["median_lines_per_s"]) == {"producer", "batch_api"}
    assert all(rate > 0 for rate in report["median_lines_per_s"].values())
    assert report["runs"]["batch_api"][0]["peak_rss_mib"]["worker"] > 0
    assert report["runs"]["batch_api"][0]["cpu_s"]["gateway"] > 0
    (latency,) = report["latency"]["rounds"]
    assert latency["alone"]["failed"] == 0 and latency["beside_batch"]["failed"] == 0
    assert latency["alone"]["p99_ms"] > 0 and latency["beside_batch"]["calls"] > 0
    assert report["latency"]["p99_ratio"] is not None and report["online_capacity_per_s"] > 0
    assert "cpu" in json.dumps(report["machine"]).lower()
