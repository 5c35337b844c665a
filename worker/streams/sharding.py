"""Redis Cluster: the shard count, and the worker's Redis parts built once per shard.

app.redis_parts calls `sharded_parts` in place of building one of each part, when the
client is a RedisCluster. Each shard gets the parts a single Redis has (reader, replier,
reclaimer, dead letters), on the shard's keys, and the sharded wrappers (shards.py,
shard_replies.py, shard_upkeep.py) present them to the pipeline as one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from producer import connection, protocol
from producer.backlog import published_shards
from producer.replicas import ReplicaCount
from producer.shards import (
    check_cluster_names,
    default_shards,
    shard_answered_key,
    shard_dead_letter_key,
    shard_lease_key,
    shard_stream_key,
    shards_key,
)
from worker.settings import Settings
from worker.streams.dead_letters import DeadLetters
from worker.streams.reader import StreamReader
from worker.streams.reclaimer import Reclaimer
from worker.streams.replier import Replier
from worker.streams.shard_replies import ForeignReplies, ShardedReplier
from worker.streams.shard_token_streams import ShardedTokenStreams
from worker.streams.shard_upkeep import ShardedDeadLetters, ShardedMaintenance, ShardedReclaimer
from worker.streams.shards import Localiser, ShardedReader
from worker.streams.token_streams import TokenStreams

log = structlog.get_logger("redbatch.shards")


def resolve_shards(client: Any, namespace: str, model: str, wanted: int) -> int:
    """The model's shard count: the published one (first comer: `wanted`, or 2 x the
    masters, with SET NX). A larger `wanted` raises it (producers then spread wider, and
    workers started since read the new shards); a smaller one is ignored: entries in the
    shards above it would be stranded."""
    key = shards_key(namespace, model)
    published = published_shards(client.get(key))
    if published is None:
        client.set(key, wanted or default_shards(connection.master_count(client)),
                   nx=True)
        published = published_shards(client.get(key))
    elif wanted > published:
        client.set(key, wanted)
        log.warning("shards.raised", model=model, shards=wanted, was=published)
        published = wanted
    elif wanted and wanted < published:
        log.warning("shards.kept", model=model, shards=published, setting=wanted,
                    reason="fewer shards would strand the entries of the others")
    if published is None:
        raise ValueError(f"{key} does not hold a shard count")
    return published


def dead_letters_of(settings: Settings, client: Any, stream: str) -> DeadLetters:
    """The dead-letter diversion of one stream (a single Redis's, or a shard's)."""
    return DeadLetters(client, stream, settings.group, settings.consumer,
                       namespace=settings.namespace, model_name=settings.model_name,
                       max_deliveries=settings.max_deliveries,
                       result_ttl_ms=settings.result_ttl_ms,
                       max_payload_bytes=settings.max_payload_bytes,
                       reply_prefixes=tuple(settings.reply_prefixes))


def sharded_parts(settings: Settings, client: Any,
                  describe: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
    """The parts that talk to Redis, one per shard, wrapped as one (see the docstring)."""
    ns, name, group, consumer = (settings.namespace, settings.model_name, settings.group,
                                 settings.consumer)
    check_cluster_names(ns, name)
    count = resolve_shards(client, ns, name, settings.shards)
    streams = [shard_stream_key(ns, name, s) for s in range(count)]
    localise = Localiser(ns, name)
    replicas = ReplicaCount(settings.replicas_to_wait, settings.replicas_wait_ms)
    reclaimers = [Reclaimer(client, stream, group, consumer, settings.claim_idle_ms, name)
                  for stream in streams]
    foreign = ForeignReplies(client, ns, settings.result_ttl_ms, name, replicas)
    dead_letters = [dead_letters_of(settings, client, stream) for stream in streams]
    for shard, letters in enumerate(dead_letters):
        letters.dead_stream = shard_dead_letter_key(ns, name, shard)
        letters.foreign = foreign
    log.info("shards.serving", model=name, shards=count,
             masters=connection.master_count(client))
    return dict(
        reader=ShardedReader([StreamReader(client, s, group, consumer) for s in streams],
                             localise),
        replier=ShardedReplier([Replier(
            client, stream, group, consumer, settings.result_ttl_ms,
            shard_answered_key(ns, name, shard), name,
            ReplicaCount(settings.replicas_to_wait, settings.replicas_wait_ms))
            for shard, stream in enumerate(streams)], foreign),
        reclaimer=ShardedReclaimer(reclaimers, localise),
        dead_letters=ShardedDeadLetters(dead_letters, localise),
        maintenance=ShardedMaintenance(
            client, reclaimers, [shard_lease_key(ns, name, s, "upkeep")
                                 for s in range(count)], group, name,
            settings.maintenance_interval_s, settings.consumer_idle_ms, describe,
            protocol.workers_key(ns, name), protocol.models_key(ns),
            {key: kind for s in range(count)
             for key, kind in protocol.internal_keys(ns, name, s).items()}))


def sharded_token_streams(settings: Settings, client: Any) -> ShardedTokenStreams:
    """A generative model's reply streams, one TokenStreams per shard."""
    ns, name = settings.namespace, settings.model_name
    count = resolve_shards(client, ns, name, settings.shards)
    return ShardedTokenStreams(
        [TokenStreams(client, shard_stream_key(ns, name, s), settings.group,
                      settings.consumer, settings.result_ttl_ms,
                      shard_answered_key(ns, name, s), name,
                      ReplicaCount(settings.replicas_to_wait,
                                              settings.replicas_wait_ms))
         for s in range(count)],
        settings.result_ttl_ms)


# What the pipeline holds: a part of a single Redis, or its sharded twin (same calls).
AnyReader = StreamReader | ShardedReader
AnyReplier = Replier | ShardedReplier
AnyReclaimer = Reclaimer | ShardedReclaimer
AnyDeadLetters = DeadLetters | ShardedDeadLetters
AnyTokenStreams = TokenStreams | ShardedTokenStreams
