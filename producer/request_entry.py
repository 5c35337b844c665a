"""A stream entry's fields: built by producers (entry_fields), parsed and checked by workers
(parse_entry, into a Request), on top of the keys and codecs of producer/protocol.py.

See docs/protocol.md, "Request entry".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from producer.entry_rules import EntryRules, rules_for
from producer.protocol import (
    CONTENT_TYPES,
    JSON,
    MAX_ID_BYTES,
    MSGPACK,
    reply_key,
    token_stream_key,
)


@dataclass(slots=True)
class Request:
    """A validated stream entry. The payload stays encoded until the worker decodes it."""

    id: str
    payload: bytes
    content_type: str
    reply_to: str
    deadline_ms: int | None = None
    priority: int = 0
    # where to answer when reply_to is of the wrong kind (derived: not part of equality)
    default_reply: str = field(default="", compare=False)

    @property
    def background(self) -> bool:
        """A batch job's line (priority < 0): it yields to every online request."""
        return self.priority < 0


class InvalidEntry(Exception):
    """A malformed entry. `request_id`/`reply_to` are set when it can still be answered;
    `payload` when it is there and within the size limit (a generative model reads its
    `stream` key to know where the error goes)."""

    def __init__(self, message: str, request_id: str | None = None,
                 reply_to: str | None = None, content_type: str = JSON,
                 payload: bytes | None = None, default_reply: str | None = None,
                 **details: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reply_to = reply_to
        self.default_reply = default_reply or reply_to
        self.content_type = content_type
        self.payload = payload
        self.details = details  # `field` at fault, `reason`: in the error envelope

    @property
    def answerable(self) -> bool:
        return self.request_id is not None and self.reply_to is not None


def entry_fields(request_id: str, payload: bytes, *, content_type: str = MSGPACK,
                 reply_to: str | None = None, deadline_ms: int | None = None,
                 priority: int = 0) -> dict[str, str | bytes | int]:
    """The fields of an XADD for one request (optional fields left out when at default)."""
    fields: dict[str, str | bytes | int] = {"id": request_id, "payload": payload}
    if content_type != MSGPACK:
        fields["content_type"] = content_type
    if reply_to is not None:
        fields["reply_to"] = reply_to
    if deadline_ms is not None:
        fields["deadline_ms"] = deadline_ms
    if priority:
        fields["priority"] = priority
    return fields


def _utf8(value: bytes, name: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidEntry(f"field '{name}' is not UTF-8") from None


def _integer(value: bytes | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"field '{name}' must be an integer, got {value[:40]!r}") from None


def parse_entry(fields: dict[bytes, bytes], namespace: str, max_payload_bytes: int, *,
                reply_prefixes: tuple[str, ...] = (), default_reply: str | None = None
                ) -> Request:
    """Validate the raw fields of a stream entry; raise InvalidEntry saying what is wrong.

    The id and reply key are recovered first, so that every later problem can still be
    answered to the client instead of silently dropped. A `reply_to` outside the reply
    prefixes is refused, on the default reply key (`default_reply`: the shard's on a
    Redis Cluster). (It runs for every request: the common path is a few dict lookups.)
    """
    raw_id = fields.get(b"id")
    if not raw_id:
        raise InvalidEntry("entry has no 'id' field")
    if len(raw_id) > MAX_ID_BYTES:
        raise InvalidEntry(f"'id' is longer than {MAX_ID_BYTES} bytes")
    request_id = _utf8(raw_id, "id")
    rules = rules_for(namespace, max_payload_bytes, reply_prefixes)
    default = default_reply or reply_key(namespace, request_id)
    reply_to = _reply_to(fields.get(b"reply_to"), default, request_id, rules)
    raw_content_type = fields.get(b"content_type")
    content_type = (MSGPACK if raw_content_type is None
                    else raw_content_type[:64].decode(errors="replace"))
    payload = fields.get(b"payload")
    deadline, priority = fields.get(b"deadline_ms"), fields.get(b"priority")
    known = 2 + (raw_content_type is not None) + (b"reply_to" in fields)
    if (content_type in CONTENT_TYPES and payload is not None and len(fields) == known
            and len(payload) <= max_payload_bytes):
        return Request(request_id, payload, content_type, reply_to,
                       default_reply=default)  # the common case
    _check_size(fields, Request(request_id, b"", JSON, reply_to, default_reply=default), rules)
    return _checked(Request(request_id, payload or b"", content_type, reply_to,
                            default_reply=default), payload is None, deadline, priority,
                    max_payload_bytes)


def _reply_to(raw: bytes | None, default: str, request_id: str, rules: EntryRules) -> str:
    """The entry's reply key: its `reply_to` when that is under an allowed prefix."""
    if not raw:
        return default
    reply_to, problem = _checked_reply_to(raw, rules)
    if problem:
        raise InvalidEntry(problem, request_id, default, field="reply_to")
    return reply_to


@functools.lru_cache(maxsize=1024)
def _checked_reply_to(raw: bytes, rules: EntryRules) -> tuple[str, str | None]:
    """The decoded `reply_to` and why it cannot be used (None: it can). Cached: a client's
    requests share its reply key, so most entries repeat a key already checked."""
    problem = rules.reply_to_problem(raw)
    return ("" if problem else raw.decode()), problem


def _check_size(fields: dict[bytes, bytes], request: Request, rules: EntryRules) -> None:
    """Refuse an entry with too many fields or too many bytes, before any work on it."""
    problem = rules.size_problem(fields)
    if problem:
        raise InvalidEntry(problem, request.id, request.reply_to,
                           default_reply=request.default_reply, reason="entry_too_large")


def _checked(request: Request, missing: bool, deadline: bytes | None, priority: bytes | None,
             max_payload_bytes: int) -> Request:
    """The rest of parse_entry: each problem is answered in the request's content type."""
    content_type, payload = request.content_type, request.payload

    def invalid(message: str, field: str, **reason: str) -> InvalidEntry:
        known = content_type in CONTENT_TYPES
        readable = payload if known and payload and len(payload) <= max_payload_bytes else None
        return InvalidEntry(message, request.id, request.reply_to,
                            content_type if known else JSON, readable,
                            request.default_reply, field=field, **reason)

    if content_type not in CONTENT_TYPES:
        raise invalid(f"unknown content_type {content_type!r}; use one of {list(CONTENT_TYPES)}",
                      "content_type")
    if missing:
        raise invalid("entry has no 'payload' field", "payload")
    if len(payload) > max_payload_bytes:
        raise invalid(f"payload is {len(payload)} bytes, above the limit of {max_payload_bytes}",
                      "payload", reason="payload_too_large")
    for name, raw in (("deadline_ms", deadline), ("priority", priority)):
        try:
            setattr(request, name, _integer(raw, name))
        except ValueError as exc:
            raise invalid(str(exc), name) from None
    request.priority = request.priority or 0
    return request


def misdirected(request: Request, streamed: bool, rules: EntryRules) -> bool:
    """Whether the request's answer would land on a key of the other kind: a streamed
    answer outside the stream prefixes, or a list reply outside the reply prefixes."""
    if streamed:
        key = token_stream_key(rules.namespace, request.id, request.reply_to)
        return not rules.stream_reply_allowed(key)
    return not rules.list_reply_allowed(request.reply_to)
