"""The clients' errors, and the one place a reply envelope turns into a result or a raise.

Shared by Client, AsyncClient and the cluster path (producer/sharded.py); re-exported from
producer.client and producer, where callers import them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RedbatchError(Exception):
    """Base of the client's errors."""


class RequestFailed(RedbatchError):
    """The worker answered with an error envelope."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class ResultTimeout(RedbatchError):
    """No reply arrived in time; the request may still be answered later."""


class Overloaded(RedbatchError):
    """Refused: the group's backlog would pass `max_backlog`. Nothing of the refused call was
    enqueued, except the ids in `submitted` (earlier chunks of a submit_many)."""

    def __init__(self, backlog: int, max_backlog: int, submitted: Sequence[str] = ()) -> None:
        super().__init__(f"backlog of {backlog} requests is at the limit of {max_backlog}; "
                         "retry later")
        self.backlog = backlog
        self.max_backlog = max_backlog
        self.submitted = list(submitted)


def unwrap(envelope: dict[str, Any]) -> Any:
    """The result of a success envelope, or RequestFailed for an error envelope."""
    if envelope["ok"]:
        return envelope["result"]
    error = envelope.get("error") or {}
    raise RequestFailed(str(envelope.get("id")), error.get("code", "unknown"),
                        error.get("message", ""))
