"""`python -m worker dead-letters`: list dead letters as JSON lines, or requeue them.

On a Redis Cluster each shard has its own dead-letter stream: the ids listed carry their
shard (`<id>@<shard>`, as the worker's entry ids do) and are requeued onto their shard.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from producer import connection
from producer.backlog import published_shards
from producer.protocol import dead_letter_key, stream_key
from producer.shards import shard_dead_letter_key, shard_stream_key, shards_key
from worker.app import connect
from worker.settings import Settings
from worker.streams.dead_letters import DeadLetter, list_dead_letters, requeue_dead_letters
from worker.streams.shards import by_shard, tagged
from worker.streams.target import redis_url


def run_dead_letters(settings: Settings, limit: int, requeue: Sequence[str],
                     requeue_all: bool) -> int:
    """List the oldest `limit` dead letters; with `requeue`, put those back on the stream."""
    with redis_url(settings) as url:
        client = connect(url, settings.block_ms, cluster=settings.redis_cluster,
                         password=settings.redis_secret)
        queues = dead_letter_queues(client, settings.namespace, settings.model_name)
        listed = [DeadLetter(tagged(d.id, shard) if shard is not None else d.id, d.fields)
                  for shard, (dead, _) in queues.items()
                  for d in list_dead_letters(client, dead, limit)][:limit]
        chosen = [d.id for d in listed] if requeue_all else list(requeue)
        if not chosen:
            for dead_letter in listed:
                print(json.dumps(dead_letter.summary(), ensure_ascii=False))
            return 0
        try:
            groups = by_shard(chosen) if None not in queues else {None: list(chosen)}
        except ValueError:
            print("redbatch: on a Redis Cluster dead-letter ids carry their shard "
                  "(<id>@<shard>, as listed)", file=sys.stderr)
            return 2
        added = [a for shard, ids in groups.items() if shard in queues
                 for a in requeue_dead_letters(client, *queues[shard], ids)]
        print(f"requeued {len(added)} of {len(chosen)} to {settings.model_name}",
              file=sys.stderr)
        return 0 if len(added) == len(chosen) else 1


def dead_letter_queues(client: Any, namespace: str,
                       model: str) -> dict[int | None, tuple[str, str]]:
    """(dead-letter stream, request stream) per shard; {None: ...} on a single Redis."""
    if not connection.is_cluster_client(client):
        return {None: (dead_letter_key(namespace, model), stream_key(namespace, model))}
    count = published_shards(client.get(shards_key(namespace, model))) or 0
    return {s: (shard_dead_letter_key(namespace, model, s),
                shard_stream_key(namespace, model, s)) for s in range(count)}
