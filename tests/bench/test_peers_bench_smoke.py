"""`python -m bench.peers` on a short input: redbatch served and offline are measured side by
side, a peer whose package is missing is reported as skipped with why, and the JSON and
markdown reports have their shape. No peer package is needed (the peers are limited to
infinity, which this project's environments cannot install), so `make test` runs it anywhere;
a change to a flag, a default or the rig under the benchmark fails here first."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common.processes import REPO_ROOT


def test_the_peers_benchmark_measures_redbatch_and_reports_a_missing_peer(tmp_path: Path
                                                                          ) -> None:
    run = subprocess.run([sys.executable, "-m", "bench.peers", "--texts", "48", "--repeats",
                          "2", "--select-texts", "48", "--batch-sizes", "16", "--peers",
                          "infinity", "--corpus-files", "40", "--out", str(tmp_path)],
                         cwd=REPO_ROOT, timeout=240, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (data,) = tmp_path.glob("*.json")
    report = json.loads(data.read_text())
    served, offline, forward = report["systems"]
    assert [served["name"], offline["name"], forward["name"]] == [
        "redbatch", "redbatch offline", "redbatch forward only"]
    assert served["dtype"] == offline["dtype"] == forward["dtype"] != "?"  # the worker said
    for row in (served, offline, forward):
        assert len(row["rates"]) == 2 and row["texts_per_s"] > 0 and row["redbatch_over"] > 0
    assert offline["config"] in offline["selection_texts_per_s"]
    assert len(offline["selection_texts_per_s"]) >= 2  # its layouts, and the worker's limits
    (skipped,) = report["skipped"]
    installed = importlib.util.find_spec("infinity_emb") is not None
    assert skipped["peer"] == "infinity"
    assert skipped["reason"].startswith("installed" if installed else "did not install")
    (goal,) = report["goals"]  # no peer measured: only the offline goal
    assert goal["same_dtype"] and goal["value"] == offline["redbatch_over"]
    assert isinstance(report["machine"]["cpu_flags"], list)
    table = data.with_suffix(".md").read_text()
    assert "| redbatch offline |" in table
    assert installed or "did not install" in table
