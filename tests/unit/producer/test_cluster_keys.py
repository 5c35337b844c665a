"""Cluster sharding without a server: every key a script touches for one shard hashes to
one slot (redis-py's key_slot is the reference), the shard cycle, and the sharded ids."""

from __future__ import annotations

import random
import string

import pytest
from redis.crc import key_slot as redis_key_slot

from producer import protocol
from producer.backlog import ADD_IF_UNDER, ADD_ONCE, ShardCycle, published_shards
from producer.batches import keys as batch_keys
from producer.shards import (
    check_cluster_names,
    key_slot,
    reply_marker_key,
    shard_answered_key,
    shard_dead_letter_key,
    shard_lease_key,
    shard_of_stream,
    shard_reply_key,
    shard_stream_key,
    shard_submitted_key,
    shard_token_stream_key,
)
from worker.streams.reader import Entry
from worker.streams.shards import Localiser, by_shard, tagged, untagged

ALPHABET = string.ascii_letters + string.digits + ":-_./@ {}é"


def names(rng: random.Random, count: int) -> list[str]:
    return [''.join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
            for _ in range(count)]


def shard_script_keys(ns: str, model: str, shard: int, request_id: str) -> dict[str, list[str]]:
    """The KEYS of each script run on one shard (worker and producer)."""
    stream = shard_stream_key(ns, model, shard)
    reply = shard_reply_key(ns, model, shard, request_id)
    return {
        "ADD_ONCE": [stream, shard_submitted_key(ns, model, shard, request_id)],
        "ADD_IF_UNDER / BACKLOG / CLAIM / TRIM / idle consumers": [stream],
        "REPLY_AND_ACK": [stream, shard_answered_key(ns, model, shard), reply],
        "MOVE_TO_DEAD": [stream, shard_dead_letter_key(ns, model, shard), reply],
        "REQUEUE": [shard_dead_letter_key(ns, model, shard), stream],
        "lease": [shard_lease_key(ns, model, shard, "upkeep"), stream],
        "FINISH_AND_ACK / KEEP_ALIVE (generative)": [
            stream, shard_answered_key(ns, model, shard),
            protocol.token_stream_key(ns, request_id, reply)],
    }


def test_every_script_of_a_shard_stays_in_one_slot() -> None:
    rng = random.Random(14)
    models = ["echo", "minilm", "a:b", "é", *(n.replace("{", "(").replace("}", ")")
                                            for n in names(rng, 300))]
    checked = 0
    for model in models:
        for shard in rng.sample(range(64), 4):
            request_id = rng.choice([*names(rng, 1), "req-1", "{tag}", "}{"])
            slots = set()
            for keys in shard_script_keys("redbatch", model, shard, request_id).values():
                slots |= {redis_key_slot(k.encode()) for k in keys}
                checked += 1
            assert len(slots) == 1, (model, shard, request_id)
    assert checked > 5000
    assert ADD_ONCE and ADD_IF_UNDER  # the scripts those KEYS are for


def test_a_batch_s_keys_and_its_files_are_in_one_slot() -> None:
    """Every script of producer/batches/scripts.py gets keys of one batch (issue 43)."""
    for _ in range(50):
        batch_id, file_id = batch_keys.new_batch_id(), batch_keys.new_file_id()
        found = batch_keys.BatchKeys("redbatch", batch_id).all()
        for kind in ("output", "errors"):
            found += batch_keys.file_keys("redbatch", batch_keys.output_file_id(batch_id, kind))
        assert len({key_slot(k) for k in found}) == 1
        assert len({key_slot(k) for k in batch_keys.file_keys("redbatch", file_id)}) == 1


def test_a_shard_s_default_reply_stream_is_its_reply_key_s_twin() -> None:
    reply = shard_reply_key("redbatch", "lm", 3, "r1")
    assert protocol.token_stream_key("redbatch", "r1", reply) == \
        shard_token_stream_key("redbatch", "lm", 3, "r1") == "redbatch:stream:{lm:3}:r1"
    assert protocol.token_stream_key("redbatch", "r1") == "redbatch:stream:r1"
    assert protocol.token_stream_key("redbatch", "r1", "mine") == "mine"
    assert protocol.token_stream_key("redbatch", "r1", "redbatch:reply:{a}:{b}:r1") == \
        "redbatch:reply:{a}:{b}:r1"  # not a shard's default reply key: used as it is


def test_our_key_slot_is_redis_pys() -> None:
    rng = random.Random(7)
    for key in [*names(rng, 2000), "{}", "{a}", "a{}b{c}", "é{x}"]:
        assert key_slot(key) == redis_key_slot(key.encode())


def test_a_foreign_reply_marker_is_in_its_reply_keys_slot() -> None:
    rng = random.Random(3)
    for reply_to in [*names(rng, 500), "redbatch:reply:shared", "{x}}", "a}b", "}{"]:
        marker = reply_marker_key("redbatch", reply_to, "redbatch:requests:{e:1}:1-0")
        assert redis_key_slot(marker.encode()) == redis_key_slot(reply_to.encode())


def test_shards_spread_over_the_slots() -> None:
    slots = {key_slot(shard_stream_key("redbatch", "echo", s))
             for s in range(6)}
    assert len(slots) == 6


def test_braces_in_the_namespace_or_model_are_refused() -> None:
    """`}m` would make the tag `{}m:0}` empty: each key would hash whole, in its own slot."""
    check_cluster_names("redbatch", "echo")
    for namespace, model in (("red{batch}", "echo"), ("redbatch", "}m"), ("redbatch", "a{b")):
        with pytest.raises(ValueError, match="may not contain"):
            check_cluster_names(namespace, model)


def test_the_cycle_goes_round_from_a_random_start() -> None:
    cycle = ShardCycle(4, start=2)
    assert cycle.take(6) == [2, 3, 0, 1, 2, 3]
    assert cycle.after(3) == [3, 0, 1, 2]
    assert cycle.spread(5) == {0: [0, 4], 1: [1], 2: [2], 3: [3]}
    assert cycle.share(10) == 3
    assert len({ShardCycle(6).take()[0] for _ in range(200)}) > 1
    assert published_shards(b"6") == 6 and published_shards(None) is None
    assert published_shards(b"x") is None


def test_sharded_ids_and_default_reply_keys() -> None:
    assert untagged(tagged("1700-3", 5)) == ("1700-3", 5)
    assert by_shard(["1-0@0", "2-0@1", "3-0@0"]) == {0: ["1-0", "3-0"], 1: ["2-0"]}
    localise = Localiser("redbatch", "echo")
    mine, theirs = Entry("1-0", {b"id": b"r1"}), Entry("2-0", {b"id": b"r2",
                                                              b"reply_to": b"shared"})
    localise([mine, theirs], 3)
    assert mine.id == "1-0@3" and mine.fields is not None
    assert mine.fields[b"reply_to"] == b"redbatch:reply:{echo:3}:r1"
    assert theirs.fields is not None and theirs.fields[b"reply_to"] == b"shared"
    assert shard_of_stream("redbatch:requests:{echo:3}") == 3
    assert shard_of_stream("redbatch:requests:echo") is None
