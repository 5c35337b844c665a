"""The reply streams' Redis side (worker/streams/token_streams.py), against a real Redis."""

from __future__ import annotations

import redis

from worker.streams.token_streams import Chunk, FinalChunk, TokenStreams

STREAM, GROUP = "redbatch:requests:m", "workers"


def streams(r: redis.Redis, consumer: str = "c1") -> TokenStreams:
    return TokenStreams(r, STREAM, GROUP, consumer, 60_000, "redbatch:answered:m")


def held_entry(r: redis.Redis, consumer: str = "c1") -> str:
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    r.xadd(STREAM, {"id": "req"})
    [[_, [(entry_id, _)]]] = r.xreadgroup(GROUP, consumer, {STREAM: ">"})
    return str(entry_id.decode())


def test_a_chunk_written_twice_is_seen_once_and_cancels_are_read(r: redis.Redis) -> None:
    writer = streams(r)
    r.set("redbatch:cancel:b", 1, px=10_000)
    chunk = Chunk("redbatch:stream:a", 1, b'{"text":"x"}')
    assert writer.write([chunk], ["redbatch:cancel:a", "redbatch:cancel:b"]) == [False, True]
    assert writer.write([chunk, Chunk("redbatch:stream:a", 2, b"y")]) == []  # a retry
    assert [e[0] for e in r.xrange("redbatch:stream:a")] == [b"1-1", b"2-1"]
    assert 0 < r.pttl("redbatch:stream:a") <= 60_000


def test_the_done_entry_and_the_ack_go_together_only_while_owned(r: redis.Redis) -> None:
    entry_id = held_entry(r)
    final = FinalChunk(entry_id, Chunk("redbatch:stream:req", 1, b"done"))
    assert streams(r, "someone-else").finish([final]) == [entry_id]  # not theirs
    assert r.xlen("redbatch:stream:req") == 0
    assert streams(r).finish([final]) == []
    assert r.xpending(STREAM, GROUP)["pending"] == 0
    assert r.xrange("redbatch:stream:req")[0][0] == b"1-1"
    assert r.get("redbatch:answered:m") == b"1"
