"""HTTP errors in OpenAI's shape, and the worker's error codes mapped to HTTP statuses.

Pure: no I/O, so the mapping is unit-tested on its own (tests/unit/producer/test_gateway_shapes.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producer.liveness import Kind
from producer.protocol import ErrorCode

# OpenAI's `error.type` per status: SDKs branch on the status, people read the type.
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error",
    504: "timeout_error",
}

# A worker's failure envelope -> (HTTP status, OpenAI `error.code`).
WORKER_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request"),
    ErrorCode.TOO_LARGE: (413, "input_too_large"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout"),
    ErrorCode.MODEL_ERROR: (500, "model_error"),
    ErrorCode.INTERNAL: (500, "internal_error"),
    ErrorCode.DEAD_LETTER: (500, "dead_letter"),
    ErrorCode.OVERLOADED: (429, "overloaded"),  # shed at read time, with retry_after_ms
    ErrorCode.DUPLICATE_ID: (409, "duplicate_id"),  # another request with its id is in flight
}


@dataclass
class ApiError(Exception):
    """Raised anywhere in a request's handling; the app turns it into the JSON response."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500
                               else "server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param)


def from_worker(error: Any) -> ApiError:
    """The ApiError for a worker's failure envelope's `error`; unknown codes are server
    errors. An `overloaded` refusal carries the worker's retry_after_ms as Retry-After
    (whole s); a payload over the worker's `max_payload_bytes` is 413."""
    error = error if isinstance(error, dict) else {}
    code, message = str(error.get("code", "")), str(error.get("message", ""))
    status, api_code = WORKER_STATUS.get(code, (500, code or "internal_error"))
    if error.get("reason") == "payload_too_large":
        status, api_code = 413, "payload_too_large"
    param = "input" if status in (400, 413) else None
    retry = error.get("retry_after_ms")
    headers = {} if not isinstance(retry, int) else {"Retry-After": str(-(-retry // 1000))}
    return ApiError(status, f"worker: {message}" if message else f"worker error {code}",
                    api_code, param, headers)


def overloaded(backlog: int, limit: int, retry_after_s: int = 1) -> ApiError:
    """429 for back-pressure: the request stream's backlog is at `max_backlog`."""
    return ApiError(429, f"the queue holds {backlog} requests, at its limit of {limit}; "
                    "retry later", "overloaded", None, {"Retry-After": str(retry_after_s)})


def unknown_model(model: str) -> ApiError:
    return ApiError(404, f"the model '{model}' does not exist: no request stream for it",
                    "model_not_found", "model")


ROUTES_OF_KIND = {Kind.EMBEDDING: "/v1/embeddings",
                  Kind.GENERATIVE: "/v1/chat/completions or /v1/completions",
                  Kind.RERANKER: "/v1/rerank"}


def wrong_model_kind(model: str, kind: Kind) -> ApiError:
    """The route does not serve the model's kind: the message names the routes that do."""
    article = "an" if kind.value[0] in "aeiou" else "a"
    return ApiError(400, f"the model '{model}' is {article} {kind.value} model: use "
                    f"{ROUTES_OF_KIND[kind]}",
                    "wrong_model_kind", "model")


def no_live_worker(model: str) -> ApiError:
    return ApiError(503, f"no live worker serves the model '{model}'; retry later",
                    "no_live_worker", "model", {"Retry-After": "5"})


QUEUE_UNAVAILABLE = "the queue is unavailable; retry later"


def queue_unavailable() -> ApiError:
    """Any Redis failure, as callers see it: the same text whatever Redis said."""
    return ApiError(503, QUEUE_UNAVAILABLE, "redis_unavailable", None, {"Retry-After": "1"})


def timed_out(seconds: float) -> ApiError:
    return ApiError(504, f"no answer from the workers within {seconds:g} s", "timeout")


def stream_timed_out(seconds: float, chunks: int) -> ApiError:
    """The last event of a stream cut at the timeout, after the chunks already sent."""
    return ApiError(504, f"the generation did not finish within {seconds:g} s: cancelled "
                    f"after {chunks} chunk(s) of text", "timeout")


# Fields redbatch does not implement, accepted at the value that changes nothing: clients
# that send every field with its default still work.
NEUTRAL_FIELDS: dict[str, Any] = {"logprobs": False, "echo": False}


def refuse_unsupported(body: dict[str, Any], known: set[str]) -> None:
    """400 for the first field that is not known, unless it is null or at a neutral value."""
    unknown = sorted(key for key, value in body.items() if key not in known
                     and value is not None and not _neutral(key, value))
    if unknown:
        raise invalid(f"unsupported field '{unknown[0]}'", unknown[0], "unsupported_parameter")


def _neutral(key: str, value: Any) -> bool:
    neutral = NEUTRAL_FIELDS.get(key, ...)
    return neutral is not ... and type(value) in (int, float, bool) and \
        isinstance(value, bool) == isinstance(neutral, bool) and value == neutral

