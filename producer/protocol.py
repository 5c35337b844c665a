"""Wire protocol v1: the key names, the payload and envelope codecs and the error codes.

Both sides import this module, so the format is defined exactly once; a stream entry's fields
(built by producers, parsed and checked by workers) are in producer/request_entry.py, on top of it.
See docs/protocol.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from enum import StrEnum
from typing import Any

import msgpack

# The Redis Cluster keys (shards of one logical queue) live in producer/shards.py.
from producer.entry_rules import MAX_CONTAINER_ITEMS, ContainerCount, whole_characters
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
