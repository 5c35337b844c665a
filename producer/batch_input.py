"""The batch CLI's input: JSONL or plain lines, read twice (a check first, then the requests
as the window takes them), so nothing is sent from an input with a bad line and the whole
file is never held in memory.

Blank lines are skipped; line numbers are the file's own (1-based, blank lines counted). A
JSON object's `id` (a string) is its request id, so a result joins back to its input; the
same id twice is refused before anything is sent.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from producer import protocol


class InputError(Exception):
    """A line of the input could not be read; the message names it."""


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as in the file
    request_id: str | None  # the JSON object's own `id`, else None (a new one is made)
    payload: Any  # the object without its `id`; a plain line's text (a str)
    plain: bool


def parse_line(number: int, raw: str) -> Line | None:
    """One line; None when blank; InputError when it is not valid JSON or its id is bad."""
    text = raw.rstrip("\r\n")
    if not text.strip():
        return None
    if not text.lstrip().startswith("{"):
        return Line(number, None, text, True)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"line {number}: invalid JSON ({exc.msg})") from None
    if not isinstance(value, dict) or "id" not in value:
        return Line(number, None, value, False)
    request_id = value.pop("id")
    if not isinstance(request_id, str) or not request_id or \
            len(request_id.encode()) > protocol.MAX_ID_BYTES:
        raise InputError(f"line {number}: id must be a non-empty string of at most "
                         f"{protocol.MAX_ID_BYTES} bytes")
    return Line(number, request_id, value, False)


def read_lines(handle: IO[str]) -> Iterator[Line]:
    """The input's non-blank lines, parsed."""
    for number, raw in enumerate(handle, start=1):
        line = parse_line(number, raw)
        if line is not None:
            yield line


def check_input(handle: IO[str]) -> int:
    """The number of requests; InputError for a bad line or an id given twice."""
    seen: dict[str, int] = {}
    count = 0
    for line in read_lines(handle):
        count += 1
        if line.request_id is None:
            continue
        if line.request_id in seen:
            raise InputError(f"line {line.number}: id {line.request_id!r} is already the id "
                             f"of line {seen[line.request_id]}; ids must be unique")
        seen[line.request_id] = line.number
    return count


def open_input(path: str) -> IO[str]:
    """The input file, or stdin spooled to a temporary file (it is read twice)."""
    if path != "-":
        return open(path, encoding="utf-8")  # noqa: SIM115 (the caller closes it)
    spool = tempfile.TemporaryFile("w+", encoding="utf-8")
    shutil.copyfileobj(sys.stdin, spool)
    spool.seek(0)
    return spool


def request_payload(line: Line, generative: bool) -> Any:
    """A plain line becomes {"prompt": line} for a generative model, else {"text": line}; a
    generative request asks for `"stream": false`, its answer on the list the CLI reads."""
    if not line.plain:
        payload = line.payload
        return {**payload, "stream": False} if generative and isinstance(payload, dict) \
            else payload
    return {"prompt": line.payload, "stream": False} if generative else {"text": line.payload}
