"""What the user sees while the worker starts: warm-up start and end lines (with a spinner
on a terminal), and no third-party progress bars inside JSON logs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

log = structlog.get_logger("redbatch")
QUIET_BARS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
              "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def quiet_progress_bars(json_logs: bool) -> bool:
    """Turn off tqdm bars (transformers, huggingface_hub, gguf) when the log is JSON or
    stderr is not a terminal, so they never interleave with log lines; True if turned off.
    Effective for libraries imported later, and for transformers if already imported."""
    if not json_logs and sys.stderr.isatty():
        return False
    for name, value in QUIET_BARS.items():
        os.environ.setdefault(name, value)
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.utils.logging.disable_progress_bar()
    hub = sys.modules.get("huggingface_hub")
    if hub is not None:
        hub.utils.disable_progress_bars()
    return True


@contextmanager
def logged_step(event: str, end: bool = True, **fields: Any) -> Iterator[None]:
    """`<event>.started`, a spinner on a terminal, and `<event>.done` with its seconds
    (`end`=False: the step logs its own end line): a warm-up of many seconds is no longer
    silent."""
    log.info(f"{event}.started", **fields)
    started = time.perf_counter()
    if sys.stderr.isatty():
        from rich.console import Console
        with Console(stderr=True).status(f"{event} …"):
            yield
    else:
        yield
    if end:
        log.info(f"{event}.done", seconds=round(time.perf_counter() - started, 2), **fields)
