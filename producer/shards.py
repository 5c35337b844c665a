"""Redis Cluster keys: one logical queue as N hash-tagged shards (docs/deploy.md).

Pure functions, re-exported from producer/protocol.py (the wire format is still defined once).
On a cluster, model m's queue is N streams; every key a script touches for shard s carries
the hash tag {m:s}, so each script runs on one node, in one slot. On a single Redis none of
these is used: the keys of producer/protocol.py stay as they are.
"""

from __future__ import annotations

import binascii
import functools


def shard_tag(model: str, shard: int) -> str:
    return f"{{{model}:{shard}}}"


def shard_stream_key(namespace: str, model: str, shard: int) -> str:
    return f"{namespace}:requests:{shard_tag(model, shard)}"


def shard_reply_key(namespace: str, model: str, shard: int, request_id: str) -> str:
    """The default reply key of a request sent to shard `shard` (in the shard's slot)."""
    return f"{namespace}:reply:{shard_tag(model, shard)}:{request_id}"


def shard_token_stream_key(namespace: str, model: str, shard: int, request_id: str) -> str:
    """The default reply stream of a generative request sent to shard `shard` (its slot)."""
    return f"{namespace}:stream:{shard_tag(model, shard)}:{request_id}"


def shard_dead_letter_key(namespace: str, model: str, shard: int) -> str:
    return f"{namespace}:dead:{shard_tag(model, shard)}"


def shard_answered_key(namespace: str, model: str, shard: int) -> str:
    return f"{namespace}:answered:{shard_tag(model, shard)}"


def shard_submitted_key(namespace: str, model: str, shard: int, request_id: str) -> str:
    """The producer's idempotence marker of a request (producer/backlog.py ADD_ONCE)."""
    return f"{namespace}:submitted:{shard_tag(model, shard)}:{request_id}"


def shard_lease_key(namespace: str, model: str, shard: int, task: str) -> str:
    """`SET NX PX`: the one worker that runs `task` (trim, idle consumers) on this shard now."""
    return f"{namespace}:lease:{shard_tag(model, shard)}:{task}"


def shards_key(namespace: str, model: str) -> str:
    """A string: the model's shard count, so a producer in any language finds it with GET."""
    return f"{namespace}:shards:{model}"


def default_shards(masters: int) -> int:
    return 2 * max(1, masters)


def shard_of_stream(stream: str) -> int | None:
    """The shard of a sharded stream key; None for a single Redis's stream key."""
    if not stream.endswith("}") or "{" not in stream:
        return None
    number = stream[stream.rindex("{") + 1:-1].rpartition(":")[2]
    return int(number) if number.isdigit() else None


def check_cluster_names(namespace: str, model: str) -> None:
    """A brace in the namespace or the model name would move the hash tag out of {m:s}
    (and one shard's keys into several slots): refuse it."""
    for what, name in (("namespace", namespace), ("model name", model)):
        if "{" in name or "}" in name:
            raise ValueError(f"{what} {name!r} may not contain '{{' or '}}' on a Redis Cluster")


HASH_SLOTS = 16384


def key_slot(key: str | bytes) -> int:
    """The cluster slot of a key (the hash tag rule of the cluster spec; CRC16 mod 16384)."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1:end]
    return binascii.crc_hqx(data, 0) % HASH_SLOTS


def slot_tag(slot: int) -> str:
    """A short hash tag content that lands in `slot`, so a key can be placed in the slot of
    any other key."""
    return _slot_tag_table()[slot]


@functools.cache
def _slot_tag_table() -> tuple[str, ...]:
    """A decimal string per slot, found once (about 110 000 CRC16s, 0.1 s); built whole
    before it is shared, so threads asking at once each get a complete table."""
    table: dict[int, str] = {}
    number = 0
    while len(table) < HASH_SLOTS:
        table.setdefault(key_slot(str(number)), str(number))
        number += 1
    return tuple(table[s] for s in range(HASH_SLOTS))


def reply_marker_key(namespace: str, reply_to: str, entry: str) -> str:
    """The idempotence marker of one reply to a client-chosen `reply_to` in another slot
    than its shard: in the reply key's slot, named by the entry (stream key and id), so
    the one push per entry is decided by one script on the reply key's node."""
    return f"{namespace}:replied:{{{slot_tag(key_slot(reply_to))}}}:{entry}"
