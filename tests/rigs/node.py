"""The Node.js examples' packages, installed once from their lock files (or the test skipped)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def npm_installed(folder: Path, installed: Path) -> Path:
    """A Node example with its packages installed (`npm ci` from its committed lock file),
    or the test skipped when node, npm or the registry is missing. `installed`: a path that
    exists once the packages are in."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    if not installed.exists():
        try:
            done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=folder,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci timed out: is the npm registry reachable?")
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (registry unreachable?): {done.stderr[-300:]}")
    return folder
