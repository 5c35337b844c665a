"""JSON in and out of the gateway through orjson.

Why: a single-text embeddings answer is 384 floats, and the stdlib encoder spent more CPU on
them than everything else in the request but the HTTP parsing; orjson writes the same
shortest round-trip floats several times faster. Requests are parsed with it too: it is
stricter (no NaN or Infinity literals, as JSON itself), and its errors are JSONDecodeErrors.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse

JSONDecodeError = orjson.JSONDecodeError


def dumps(content: Any) -> bytes:
    return orjson.dumps(content)


def loads(data: bytes | bytearray | str) -> Any:
    return orjson.loads(data)


class FastJSONResponse(JSONResponse):
    """Starlette's JSONResponse, rendered by orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
