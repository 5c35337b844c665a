"""JSON log lines (the default off a terminal) keep the traceback of a logged exception."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.rigs.paths import REPO_ROOT

ROOT = REPO_ROOT

SCRIPT = """
import structlog
from worker.observe.log import configure_logging
configure_logging("info", "json")
try:
    1 / 0
except ZeroDivisionError:
    structlog.get_logger().exception("batch.failed", size=3)
"""


def test_json_lines_carry_the_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    [line] = done.stderr.splitlines()
    record = json.loads(line)
    assert (record["event"], record["level"], record["size"]) == ("batch.failed", "error", 3)
    assert "Traceback" in record["exception"] and "ZeroDivisionError" in record["exception"]
