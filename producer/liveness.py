"""Which workers are live, from their announcements: the pure part of model discovery.

Workers announce themselves in `<ns>:workers:<model>` (a hash of JSON objects with
`seen_ms`, `started_ms`, `kind`) and in the registry `<ns>:models` (model -> JSON
`{"seen_ms", "kind"}`); a worker is live when its `seen_ms` is within the idle
threshold. `kind` (Kind) is what the model serves; an announcement from before kinds carries
only a `generative` flag, read as `generative` or `embedding`. Shared by the gateway
(producer/gateway/discovery.py) and the clients (producer/models.py), so both call the same
worker live.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """What a model serves, so that each route takes only the models it can answer for."""

    EMBEDDING = "embedding"  # {"text"} -> {"embedding"}: /v1/embeddings
    GENERATIVE = "generative"  # {"prompt" | "messages"} -> text: the completion routes
    RERANKER = "reranker"  # {"query", "text"} -> {"score"}: /v1/rerank


def announced(raw: dict[Any, Any]) -> list[dict[str, Any]]:
    """The workers' announcements (worker/streams/maintenance.py), the unreadable left out."""
    found = []
    for text in raw.values():
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def seen_since(now_ms: float, idle_ms: float) -> float:
    """The oldest `seen_ms` that still counts as live."""
    return now_ms - idle_ms


def live_workers(workers: list[dict[str, Any]], now_ms: float,
                 idle_ms: float) -> list[dict[str, Any]]:
    """The announcements whose `seen_ms` is within `idle_ms` of `now_ms`."""
    since = seen_since(now_ms, idle_ms)
    return [w for w in workers if isinstance(w.get("seen_ms"), int) and w["seen_ms"] > since]


def kind_said(value: dict[str, Any]) -> Kind | None:
    """The kind one announcement (or registry entry) says: its `kind`, else the flag of
    an announcement older than kinds; None when it says neither."""
    said = value.get("kind")
    if isinstance(said, str) and said in Kind.__members__.values():
        return Kind(said)
    flag = value.get("generative")
    if isinstance(flag, bool):
        return Kind.GENERATIVE if flag else Kind.EMBEDDING
    return None


def kind_of(workers: list[dict[str, Any]]) -> Kind | None:
    """The kind the workers serve; None when none says, or they disagree."""
    kinds = {kind for kind in map(kind_said, workers) if kind is not None}
    return kinds.pop() if len(kinds) == 1 else None


def generative_of(workers: list[dict[str, Any]]) -> bool | None:
    """Whether the workers serve a generative model; None when none says, or they disagree."""
    kind = kind_of(workers)
    return None if kind is None else kind is Kind.GENERATIVE


def registry_entry(entry: Any) -> dict[str, Any]:
    """A registry entry (protocol.models_key) as a dict; empty when unreadable."""
    try:
        value = json.loads(entry)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def registry_seen_ms(entry: Any) -> int:
    """A registry entry's `seen_ms`; 0 when unreadable."""
    seen = registry_entry(entry).get("seen_ms")
    return seen if isinstance(seen, int) else 0
