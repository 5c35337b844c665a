"""structlog set-up: JSON lines by default, readable console output on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from worker.observe.startup import quiet_progress_bars


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    quiet_progress_bars(json_logs=not console)
    # The console renderer prints tracebacks itself (plain: rich's would show local variables,
    # request payloads among them); JSON needs them turned into a field.
    console_renderer = structlog.dev.ConsoleRenderer(
        exception_formatter=structlog.dev.plain_traceback)
    renderers = ([console_renderer] if console else
                 [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
