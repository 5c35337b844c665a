"""A batch's input lines in, worker payloads and OpenAI's output lines out. Pure.

An input line is `{custom_id, method, url, body}`; its body is checked and turned into
worker payloads by the same shape functions as the gateway's own routes, so a batch line
and an online call accept and answer the same things. An output line is
`{id, custom_id, response: {status_code, request_id, body}, error}`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from producer.gateway import generation_shapes as gen
from producer.gateway import jsonio, openai_shapes, rerank_shapes
from producer.gateway.errors import ApiError, from_worker
from producer.liveness import Kind
from producer.protocol import ErrorCode

ENDPOINTS = {"/v1/embeddings": Kind.EMBEDDING, "/v1/chat/completions": Kind.GENERATIVE,
             "/v1/completions": Kind.GENERATIVE, "/v1/rerank": Kind.RERANKER}
MAX_CUSTOM_ID_CHARS = 512
EXPIRED = ("batch_expired", "This request could not be executed before the completion "
           "window expired.")
CANCELLED = ("batch_cancelled", "This request was not executed: the batch was cancelled.")


class LineProblem(Exception):
    """An input line the batch cannot take: the batch fails with it in `errors`."""

    def __init__(self, message: str, code: str = "invalid_line", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True, slots=True)
class InputLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def read_line(raw: bytes | str, max_line_bytes: int) -> InputLine:
    """One JSONL line, its fields checked (LineProblem otherwise)."""
    if len(raw) > max_line_bytes:
        raise LineProblem(f"the line is {len(raw)} bytes, above the limit of "
                          f"{max_line_bytes}", "line_too_large")
    try:
        value = jsonio.loads(raw)
    except jsonio.JSONDecodeError:
        raise LineProblem("the line is not valid JSON", "invalid_json") from None
    if not isinstance(value, dict):
        raise LineProblem("the line must be a JSON object", "invalid_json")
    custom_id, body = value.get("custom_id"), value.get("body")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise LineProblem(f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID_CHARS} "
                          "characters", param="custom_id")
    if value.get("method", "POST") != "POST":
        raise LineProblem("'method' must be POST", param="method")
    if value.get("url") not in ENDPOINTS:
        raise LineProblem(f"'url' must be one of {sorted(ENDPOINTS)}", "invalid_url", "url")
    if not isinstance(body, dict):
        raise LineProblem("'body' must be a JSON object", param="body")
    return InputLine(custom_id, value["url"], body)


class Validator:
    """The checks that span lines: custom_id unique, one url (the batch's endpoint) and
    one model per file, the line limit. Fed line by line, so memory is the ids alone."""

    def __init__(self, endpoint: str, max_lines: int, max_line_bytes: int,
                 max_errors: int = 100) -> None:
        self.endpoint, self.max_lines, self.max_line_bytes = endpoint, max_lines, max_line_bytes
        self.max_errors = max_errors
        self.model: str | None = None
        self.ids: set[str] = set()
        self.errors: list[dict[str, Any]] = []
        self.lines = 0

    def feed(self, number: int, raw: bytes) -> None:
        """Line `number` (1-based, as OpenAI counts)."""
        self.lines += 1
        try:
            self._check(read_line(raw, self.max_line_bytes))
        except LineProblem as exc:
            if len(self.errors) < self.max_errors:
                self.errors.append({"code": exc.code, "message": str(exc),
                                    "param": exc.param, "line": number})

    def _check(self, line: InputLine) -> None:
        if line.url != self.endpoint:
            raise LineProblem(f"the line's url {line.url!r} is not the batch's endpoint "
                              f"{self.endpoint!r}", "mismatched_url", "url")
        if line.custom_id in self.ids:
            raise LineProblem(f"the custom_id {line.custom_id!r} is used by an earlier line",
                              "duplicate_custom_id", "custom_id")
        self.ids.add(line.custom_id)
        model = line.body.get("model")
        if not isinstance(model, str) or not model:
            raise LineProblem("'body.model' is required", "missing_model", "body.model")
        if self.model is not None and model != self.model:
            raise LineProblem(f"the file names the models {self.model!r} and {model!r}: one "
                              "model per file", "mismatched_model", "body.model")
        self.model = model

    def finish(self) -> list[dict[str, Any]]:
        """Every error found, the line limit and an empty file included."""
        if self.lines > self.max_lines:
            self.errors.insert(0, problem("too_many_lines", f"the file holds {self.lines} "
                                          f"lines, above the limit of {self.max_lines}"))
        if not self.lines:
            self.errors.append(problem("empty_file", "the input file holds no lines"))
        return self.errors


def problem(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An error of the whole file (no line), as a failed batch's `errors` lists it."""
    return {"code": code, "message": message, "param": param, "line": None}


Shaper = Callable[[str, list[dict[str, Any]]], Any]  # (request id, results) -> body


@dataclass(frozen=True, slots=True)
class Work:
    """What one line sends to the workers, and how their results become its body."""

    payloads: list[dict[str, Any]]
    shape: Shaper


def work_of(line: InputLine, max_inputs: int, created: int) -> Work:
    """The line's worker payloads (ApiError 400 for a body the route would refuse)."""
    if line.url == "/v1/embeddings":
        request = openai_shapes.parse_embedding_request(line.body, max_inputs)
        return Work([{"text": t} for t in request.inputs],
                    lambda _id, results: openai_shapes.embeddings_response(request, results))
    if line.url == "/v1/rerank":
        rerank = rerank_shapes.parse_rerank_request(line.body, max_inputs)
        return Work(rerank_shapes.worker_payloads(rerank),
                    lambda _id, results: rerank_shapes.rerank_response(rerank, results))
    parse = gen.parse_chat_request if line.url == "/v1/chat/completions" \
        else gen.parse_completion_request
    generation = parse(line.body)
    if generation.stream:
        raise ApiError(400, "'stream' is not supported in a batch", "invalid_request", "stream")
    payload = {**generation.payload, "stream": False}
    return Work([payload], lambda rid, results: gen.completion_response(
        generation, rid, created, results[0]))


def answered(custom_id: str, request_id: str, status: int, body: Any) -> dict[str, Any]:
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def unanswered(custom_id: str, request_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that never ran (expired, cancelled): `response` null, as OpenAI writes it."""
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


RETRY = "retry"  # the line goes back to wait for room (shed under online load)
EXPIRE = "expire"
IGNORE = "ignore"  # an answer that settles nothing (a duplicate's refusal)


def outcome(envelopes: Sequence[dict[str, Any]]) -> str | None:
    """What a complete set of a line's envelopes asks for besides an answer, or None."""
    codes = {str((e.get("error") or {}).get("code")) for e in envelopes if not e.get("ok")}
    if ErrorCode.DUPLICATE_ID.value in codes:
        return IGNORE
    if ErrorCode.OVERLOADED.value in codes:
        return RETRY
    if ErrorCode.DEADLINE_EXCEEDED.value in codes:
        return EXPIRE
    return None


def output_of(line: InputLine, work: Work, request_id: str,
              envelopes: Sequence[dict[str, Any]]) -> tuple[bool, dict[str, Any]]:
    """(succeeded, output line) from the line's envelopes, in part order."""
    failure = next((e for e in envelopes if not e.get("ok")), None)
    try:
        if failure is not None:
            raise from_worker(failure.get("error"))
        body = work.shape(request_id, [e.get("result") or {} for e in envelopes])
    except ApiError as exc:
        return False, answered(line.custom_id, request_id, exc.status, exc.body())
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        error = ApiError(500, f"the model's result does not fit {line.url}: "
                         f"{type(exc).__name__}", "unexpected_result")
        return False, answered(line.custom_id, request_id, 500, error.body())
    return True, answered(line.custom_id, request_id, 200, body)


def custom_id(raw: bytes | None) -> str | None:
    """A stored line's custom_id, if it has one (for the error line of a line never run)."""
    try:
        value = jsonio.loads(raw or b"")
    except jsonio.JSONDecodeError:
        return None
    found = value.get("custom_id") if isinstance(value, dict) else None
    return found if isinstance(found, str) else None


def refusal_line(request_id: str, raw: bytes | None, exc: Exception) -> bytes:
    """The output line of a line whose body the route refuses: its 400, as online."""
    error = exc if isinstance(exc, ApiError) else ApiError(400, str(exc), "invalid_request")
    return jsonio.dumps(answered(custom_id(raw) or "", request_id, error.status, error.body()))
