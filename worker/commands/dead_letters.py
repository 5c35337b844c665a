"""`python -m worker dead-letters`: list dead letters as JSON lines, or requeue them."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from producer.protocol import dead_letter_key, stream_key
from worker.app import connect, redis_url
from worker.settings import Settings
from worker.streams.dead_letters import list_dead_letters, requeue_dead_letters


def run_dead_letters(settings: Settings, limit: int, requeue: Sequence[str],
                     requeue_all: bool) -> int:
    """List the oldest `limit` dead letters; with `requeue`, put those back on the stream."""
    dead_stream = dead_letter_key(settings.namespace, settings.model_name)
    with redis_url(settings) as url:
        client = connect(url, settings.block_ms, cluster=settings.redis_cluster)
        listed = list_dead_letters(client, dead_stream, limit)
        chosen = [d.id for d in listed] if requeue_all else list(requeue)
        if not chosen:
            for dead in listed:
                print(json.dumps(dead.summary(), ensure_ascii=False))
            return 0
        added = requeue_dead_letters(client, dead_stream,
                                     stream_key(settings.namespace, settings.model_name), chosen)
        print(f"requeued {len(added)} of {len(chosen)} to {settings.model_name}",
              file=sys.stderr)
        return 0 if len(added) == len(chosen) else 1
