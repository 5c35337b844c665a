"""Wire protocol v1: the stream entries producers write and the reply envelopes workers send back.

Both sides import this module, so the format is defined exactly once. See docs/protocol.md.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack

# The Redis Cluster keys (shards of one logical queue) live in producer/shards.py.
from producer.entry_rules import (
    MAX_CONTAINER_ITEMS,
    ContainerCount,
    EntryRules,
    rules_for,
    whole_characters,
)
from producer.shards import shard_answered_key, shard_dead_letter_key

DEFAULT_NAMESPACE = "redbatch"
DEFAULT_GROUP = "workers"
MSGPACK = "application/msgpack"
JSON = "application/json"
CONTENT_TYPES = (MSGPACK, JSON)
MAX_ID_BYTES = 256


class ErrorCode(StrEnum):
    """Codes carried in failure envelopes; clients branch on these, never on messages."""

    INVALID_REQUEST = "invalid_request"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    MODEL_ERROR = "model_error"
    INTERNAL = "internal"
    TOO_LARGE = "too_large"
    DEAD_LETTER = "dead_letter"
    DUPLICATE_ID = "duplicate_id"  # another entry with this id is in flight
    OVERLOADED = "overloaded"  # predicted to miss the latency target: retry after retry_after_ms


def stream_key(namespace: str, model: str) -> str:
    return f"{namespace}:requests:{model}"


def reply_key(namespace: str, request_id: str) -> str:
    return f"{namespace}:reply:{request_id}"


def inflight_key(namespace: str, reply_to: str, request_id: str) -> str:
    """The marker naming the entry that serves request `request_id` onto `reply_to`: `SET
    NX` at read time refuses a second entry with the same id and reply key while the first
    may still be answered (docs/protocol.md, "Ids")."""
    return f"{namespace}:inflight:{reply_to}:{request_id}"


def dead_letter_key(namespace: str, model: str) -> str:
    return f"{namespace}:dead:{model}"


def answered_key(namespace: str, model: str) -> str:
    """A counter of the replies written for a model, by every worker (throughput, drain time)."""
    return f"{namespace}:answered:{model}"


def workers_key(namespace: str, model: str) -> str:
    """A hash of the model's workers: consumer name -> JSON of its layout and device."""
    return f"{namespace}:workers:{model}"


def internal_keys(namespace: str, model: str, shard: int | None = None) -> dict[str, str]:
    """The keys a worker writes besides replies, and the type it keeps in each (a shard's
    own on a Redis Cluster): checked at start, since a key of another type there has its
    writes skipped."""
    if shard is None:
        answered, dead = answered_key(namespace, model), dead_letter_key(namespace, model)
    else:
        answered = shard_answered_key(namespace, model, shard)
        dead = shard_dead_letter_key(namespace, model, shard)
    return {answered: "string", dead: "stream", workers_key(namespace, model): "hash",
            models_key(namespace): "hash"}


def models_key(namespace: str) -> str:
    """The model registry, a hash model -> JSON {"seen_ms", "kind"}: every worker
    refreshes its model's entry when it announces itself, so the gateway lists the models
    without scanning the keyspace."""
    return f"{namespace}:models"


def token_stream_key(namespace: str, request_id: str, reply_to: str | None = None) -> str:
    """Where a generative model streams its answer: `reply_to` when the request named one,
    else a stream of its own. A default list reply key counts as none: `<ns>:reply:<id>`
    streams to `<ns>:stream:<id>`, and on a Redis Cluster the shard's
    `<ns>:reply:{<m>:<s>}:<id>` to `<ns>:stream:{<m>:<s>}:<id>` (in the shard's slot)."""
    if not reply_to or reply_to == reply_key(namespace, request_id):
        return f"{namespace}:stream:{request_id}"
    prefix, suffix = f"{namespace}:reply:{{", f"}}:{request_id}"
    tag = reply_to[len(prefix) - 1:-len(suffix) + 1]
    if reply_to.startswith(prefix) and reply_to.endswith(suffix) and tag.count("}") == 1:
        return f"{namespace}:stream:{tag}:{request_id}"
    return reply_to


def cancel_key(namespace: str, request_id: str) -> str:
    """`SET <key> 1 PX <ms>` cancels a generation between two decoding steps."""
    return f"{namespace}:cancel:{request_id}"


# --- payload and envelope codecs -------------------------------------------------------------


_local = threading.local()


def encode(obj: Any, content_type: str) -> bytes:
    """Encode a payload or envelope; JSON for JSON requests, msgpack otherwise."""
    if content_type == JSON:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return _packer().pack(obj)


def _packer() -> msgpack.Packer:
    """One reused Packer per thread: msgpack.packb builds a new one per call, which costs
    as much as the packing (a Packer resets itself after a failed pack)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


def decode(data: bytes, content_type: str) -> Any:
    """Decode a payload within the container limits; raises ValueError with a readable
    reason on bad or oversized input."""
    count = ContainerCount()
    if content_type == JSON:
        try:
            obj = count.with_arrays(json.loads(data, object_hook=count), data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"payload is not valid JSON: {exc}") from None
        except RecursionError:  # e.g. '[[[[...', well within the size limit
            raise ValueError("payload is not valid JSON: nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"payload is too complex: {exc}") from None
        return whole_characters(obj, data)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, object_hook=count,
                               list_hook=count, max_str_len=len(data),
                               max_bin_len=len(data), max_array_len=MAX_CONTAINER_ITEMS,
                               max_map_len=MAX_CONTAINER_ITEMS, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        reason = str(exc) or type(exc).__name__  # StackError has no message
        raise ValueError(f"payload is not valid msgpack: {reason}") from None


def decode_envelope(data: bytes) -> dict[str, Any]:
    """Decode a reply without knowing its content type: a JSON envelope starts with '{'."""
    if data[:1] == b"{":
        envelope = json.loads(data)
    else:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(envelope, dict) or "ok" not in envelope:
        raise ValueError("reply is not a redbatch envelope")
    return envelope


def envelope_for(data: bytes, request_ids: Collection[str]) -> dict[str, Any] | None:
    """The envelope in `data` when it answers one of `request_ids`, else None: a reply key
    can receive envelopes of others' requests (any producer may name it as its reply_to)."""
    try:
        envelope = decode_envelope(data)
    except Exception:  # not an envelope at all: json and msgpack raise several types
        return None
    return envelope if envelope.get("id") in request_ids else None


def success_envelope(request_id: str, result: Any, meta: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "ok": True, "result": result, "meta": meta}


def error_envelope(request_id: str, code: ErrorCode | str, message: str,
                   **details: Any) -> dict[str, Any]:
    """`details`: extra fields of the error, e.g. retry_after_ms for `overloaded`."""
    return {"id": request_id, "ok": False,
            "error": {"code": str(code), "message": message, **details}}


# --- stream entries ---------------------------------------------------------------------------


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
