"""Generative models on a real 3-master + 3-replica Redis Cluster (tests/rigs/cluster.py),
with the tiny GPT-2 (tests/rigs/tiny_lm.py): token streams in each shard's slot by default, a
client-chosen reply stream in another slot (its done entry in two steps), non-streamed
answers, and a worker killed with SIGKILL mid-generation whose requests another worker
continues: every stream complete, each chunk once, the text of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import Client
from producer.replicas import ReplicaCount
from producer.shards import key_slot, shard_answered_key, shard_stream_key, shard_token_stream_key
from tests.redis.cluster.test_cluster import worker_process
from tests.redis.single.test_generation_durability import entries_of
from tests.rigs.cluster import ClusterRig, cluster, cluster_worker, paused, rig
from tests.rigs.servers import wait_until
from tests.rigs.tiny_lm import build_tiny_lm

__all__ = ["cluster", "rig"]  # the fixtures, imported for pytest
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = ["the quick brown fox", "redis streams carry requests", "hello world, hello",
           "what is the capital of", "continuous batching lets new", "the lazy dog"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-cluster"))


def options(tiny_path: Path) -> dict[str, Any]:
    return {"path": str(tiny_path), "max_new_tokens": 24, "max_new_tokens_limit": 120}


def is_done(client: Any, key: str) -> bool:
    entries = entries_of(client, key)
    return bool(entries) and entries[-1][1]["type"] == "done"


def complete_text(client: Any, key: str) -> str:
    """The stream's text, checked: ids 1-1, 2-1, ... each once, a done entry last whose
    text is the deltas' text."""
    entries = entries_of(client, key)
    assert [i for i, _ in entries] == [f"{n}-1" for n in range(1, len(entries) + 1)]
    *deltas, (_, done) = entries
    assert [d["index"] for _, d in deltas] == list(range(1, len(deltas) + 1))
    assert done["type"] == "done" and done["ok"], done
    text = "".join(d["text"] for _, d in deltas)
    assert text == done["result"]["text"]
    return text


def pending_everywhere(client: Client, count: int) -> int:
    return sum(client.redis.xpending(shard_stream_key("redbatch", "causal_lm", s),
                                     "workers")["pending"] for s in range(count))


def test_generation_streams_on_a_cluster(rig: ClusterRig, tiny_path: Path) -> None:
    url = rig.url()
    client = Client(url, "causal_lm", cluster=True)
    with cluster_worker(url, "causal_lm", model_options=options(tiny_path)):
        own = client.submit_many([{"prompt": p} for p in PROMPTS])
        foreign = [f"redbatch:stream:{uuid.uuid4().hex}" for _ in PROMPTS]
        elsewhere = [client.submit({"prompt": p}, reply_to=key)
                     for p, key in zip(PROMPTS, foreign, strict=True)]
        quiet = client.submit({"prompt": PROMPTS[0], "stream": False})
        keys = [client.token_stream_key(i) for i in own]
        assert all("{causal_lm:" in k for k in keys)  # each in its shard's slot
        assert len({key_slot(k) for k in foreign}) > 1
        wait_until(lambda: all(is_done(client.redis, k) for k in keys + foreign), 60,
                   "every done entry")
        assert client.result(quiet, timeout=30)["text"] == complete_text(client.redis, keys[0])
    for key in keys + foreign:
        complete_text(client.redis, key)
    assert [complete_text(client.redis, k) for k in keys] == \
        [complete_text(client.redis, k) for k in foreign]  # greedy: the same prompts
    assert len(elsewhere) == len(foreign) and pending_everywhere(client, 6) == 0
    client.close()


def test_a_worker_killed_mid_generation_on_a_cluster_is_continued(
        rig: ClusterRig, tiny_path: Path, tmp_path: Path) -> None:
    """Worker A (a process) is killed with SIGKILL once every stream has chunks; worker B
    claims the entries, reads each stream on its node, and continues at the next chunk:
    each stream then holds what A wrote, followed by B's chunks, none twice. (That the
    text equals an uninterrupted run is test_generation_durability's: across two
    processes with other thread counts a near-tie may go the other way.)"""
    url = rig.url()
    client = Client(url, "causal_lm", cluster=True)
    payloads = [{"prompt": p, "max_new_tokens": 100} for p in PROMPTS]
    victim = worker_process(url, tmp_path / "a.log", model="causal_lm", consumer="victim",
                            model_options=json.dumps(options(tiny_path)), warmup="false",
                            claim_idle_ms=600, block_ms=100)
    try:
        ids = client.submit_many(payloads)
        keys = [client.token_stream_key(i) for i in ids]
        wait_until(lambda: all(len(entries_of(client.redis, k)) >= 3 for k in keys), 90,
                   "worker A never streamed")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        before = {k: entries_of(client.redis, k) for k in keys}
        assert not all(is_done(client.redis, k) for k in keys)
        with cluster_worker(url, "causal_lm", model_options=options(tiny_path),
                            consumer="rescuer", claim_idle_ms=600):
            wait_until(lambda: all(is_done(client.redis, k) for k in keys), 60, "resumed")
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    for key in keys:
        complete_text(client.redis, key)  # contiguous ids, each chunk once, done last
        after = entries_of(client.redis, key)
        assert after[:len(before[key])] == before[key]  # A's chunks kept, none rewritten
    resumed = [entries_of(client.redis, k)[-1][1]["meta"].get("resumed_at") for k in keys]
    assert any(resumed)
    assert pending_everywhere(client, 6) == 0
    client.close()


def test_reply_streams_in_another_slot_get_one_done_entry(rig: ClusterRig) -> None:
    """Step 1 written twice (a crash before the ack, then the claimant): one done entry."""
    from worker.streams.shard_token_streams import DONE_ELSEWHERE

    with redis.RedisCluster.from_url(rig.url()) as client:
        key = "mystreams:x"
        client.xadd(key, {"data": b'{"type":"delta"}'}, id="1-1")
        script = client.register_script(DONE_ELSEWHERE)
        for _ in range(2):
            script(keys=[key], args=[60000, "2-1", b'{"type":"done","ok":true}'])
        assert [e[0] for e in client.xrange(key)] == [b"1-1", b"2-1"]
        assert 0 < client.pttl(key) <= 60000


def test_a_done_entry_and_its_ack_wait_for_the_shard_s_replica(rig: ClusterRig) -> None:
    """TokenStreams.finish runs WAIT on the shard master's connection: met while the
    replica answers (a long WAIT timeout: it returns as soon as the replica acknowledges),
    short (counted) while it is stopped (SIGSTOP); the entry is answered either way."""
    from worker.observe import metrics
    from worker.streams.token_streams import Chunk, FinalChunk, TokenStreams

    with redis.RedisCluster.from_url(rig.url()) as client:
        stream = shard_stream_key("redbatch", "lm", 0)

        def token_streams(replicas: ReplicaCount) -> TokenStreams:
            return TokenStreams(client, stream, "workers", "me", 60000,
                                shard_answered_key("redbatch", "lm", 0), "lm",
                                replicas)

        client.xgroup_create(stream, "workers", id="0", mkstream=True)
        short = metrics.REPLICATION_SHORT.labels("lm")

        def finish_one(streams: TokenStreams, index: int) -> None:
            entry = client.xadd(stream, {"id": f"r{index}"}).decode()
            client.xreadgroup("workers", "me", {stream: ">"})
            key = shard_token_stream_key("redbatch", "lm", 0, f"r{index}")
            assert streams.finish([FinalChunk(entry, Chunk(key, 1, b'{"type":"done"}'))]) == []
            assert client.xlen(key) == 1

        before = short._value.get()
        finish_one(token_streams(ReplicaCount(1, 5000)), 1)
        assert short._value.get() == before  # the replica acknowledged
        with paused(rig.replica_of(rig.master_of(stream))):
            finish_one(token_streams(ReplicaCount(1, 50)), 2)
        assert short._value.get() == before + 1
        assert client.xpending(stream, "workers")["pending"] == 0
