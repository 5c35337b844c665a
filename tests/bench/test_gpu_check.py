"""bench/gpu_check.py without a GPU: one clear line, exit 0 (with one, it runs the checks)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.rigs.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs for minutes")
def test_gpu_check_says_no_cuda_device_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, timeout=120,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
