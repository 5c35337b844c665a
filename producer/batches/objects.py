"""OpenAI's file and batch objects from their stored hashes, and the batch's statuses. Pure.

Every field the `openai` client reads is present and typed as OpenAI sends it: absent ids
and times are null (never ""), counts are integers, `errors` and `metadata` objects or null.
"""

from __future__ import annotations

import json
import re
from typing import Any

VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
FINAL = (FAILED, COMPLETED, EXPIRED, CANCELLED)
TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
         "failed_at", "expired_at", "cancelling_at", "cancelled_at")
WINDOW = re.compile(r"([1-9][0-9]*)([smh])")
UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def text(meta: dict[Any, Any], name: str) -> str | None:
    value = meta.get(name.encode(), meta.get(name))
    if value in (None, b"", ""):
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def integer(meta: dict[Any, Any], name: str) -> int | None:
    value = text(meta, name)
    return int(value) if value is not None else None


def batch_object(meta: dict[Any, Any]) -> dict[str, Any]:
    errors, metadata = text(meta, "errors"), text(meta, "metadata")
    obj: dict[str, Any] = {
        "id": text(meta, "id"), "object": "batch", "endpoint": text(meta, "endpoint"),
        "model": text(meta, "model"), "errors": json.loads(errors) if errors else None,
        "input_file_id": text(meta, "input_file_id"),
        "completion_window": text(meta, "completion_window"), "status": text(meta, "status"),
        "output_file_id": text(meta, "output_file_id"),
        "error_file_id": text(meta, "error_file_id"),
        "request_counts": {name: integer(meta, name) or 0
                           for name in ("total", "completed", "failed")},
        "metadata": json.loads(metadata) if metadata else None}
    obj.update({name: integer(meta, name) for name in TIMES})
    return obj


def file_object(meta: dict[Any, Any]) -> dict[str, Any]:
    return {"id": text(meta, "id"), "object": "file", "bytes": integer(meta, "bytes") or 0,
            "created_at": integer(meta, "created_at"), "filename": text(meta, "filename"),
            "purpose": text(meta, "purpose"), "status": "processed", "status_details": None,
            "expires_at": None}


def window_seconds(window: Any) -> int | None:
    """The completion window in seconds: OpenAI's "24h", or (redbatch) any shorter
    `<n>s`, `<n>m` or `<n>h`; None when it is not one."""
    found = WINDOW.fullmatch(window) if isinstance(window, str) else None
    if not found:
        return None
    seconds = int(found.group(1)) * UNIT_S[found.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None


def metadata_problem(metadata: Any) -> str | None:
    """Why `metadata` is not OpenAI's (at most 16 string pairs, keys 64, values 512)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        return f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs"
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) \
                or len(value) > MAX_METADATA_VALUE:
            return (f"'metadata' keys are strings of at most {MAX_METADATA_KEY} characters, "
                    f"values of at most {MAX_METADATA_VALUE}")
    return None


def rate(meta: dict[Any, Any], now_s: float) -> tuple[float, float | None]:
    """(lines per second since the batch started, seconds left at that rate or None)."""
    started = integer(meta, "in_progress_at")
    done = (integer(meta, "completed") or 0) + (integer(meta, "failed") or 0)
    total = integer(meta, "total") or 0
    if started is None or now_s <= started or not done:
        return 0.0, None
    per_s = done / (now_s - started)
    return per_s, (total - done) / per_s
