"""The reliability scripts against a real Redis: reclaim, dead letters, trim, back-pressure."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import redis
from prometheus_client import REGISTRY

from producer import AsyncClient, Client, Overloaded
from producer.protocol import dead_letter_key, decode_envelope, stream_key
from producer.request_entry import entry_fields
from tests.e2e.test_producer_cli import announce
from worker.commands.dead_letters import run_dead_letters
from worker.settings import load_settings
from worker.streams.dead_letters import DeadLetters, list_dead_letters, requeue_dead_letters
from worker.streams.maintenance import Maintenance
from worker.streams.reader import StreamReader
from worker.streams.reclaimer import Reclaimer
from worker.streams.replier import Replier, Reply

STREAM = stream_key("redbatch", "echo")
GROUP = "workers"


def add(r: redis.Redis, n: int, prefix: str = "req") -> list[str]:
    return [r.xadd(STREAM, entry_fields(f"{prefix}{i}", b"\x80")).decode() for i in range(n)]


def deliver(r: redis.Redis, consumer: str, count: int) -> list[str]:
    """Read `count` new entries as `consumer` (who then owns them)."""
    response = r.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count)
    time.sleep(0.01)  # idle longer than the reclaimers' 1 ms below
    return [entry_id.decode() for entry_id, _ in response[0][1]] if response else []


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(f"redbatch_{name}_total", {"model": "echo"}) or 0.0


def pending_count(r: redis.Redis) -> int:
    return int(r.xpending(STREAM, GROUP)["pending"])


@pytest.fixture
def group(r: redis.Redis) -> redis.Redis:
    StreamReader(r, STREAM, GROUP, "setup").ensure_group()
    return r


def reclaimer(r: redis.Redis, consumer: str = "rescuer", idle_ms: int = 1) -> Reclaimer:
    return Reclaimer(r, STREAM, GROUP, consumer, idle_ms, "echo")


def test_reclaimer_follows_its_cursor_and_claims_each_entry_once(group: redis.Redis) -> None:
    ids = add(group, 40)
    deliver(group, "ghost", 40)
    rescuer = reclaimer(group)
    reclaimed_before = counted("reclaimed_entries")
    claimed: list[str] = []
    for _ in range(20):
        claimed += [e.id for e in rescuer.claim(7)]
        if rescuer.cursor == "0-0":
            break
    assert claimed == ids  # in order, no entry twice: the cursor moved on each time
    assert counted("reclaimed_entries") - reclaimed_before == 40
    assert all(e.redelivered for e in rescuer.claim(1) or [])
    info = {c["name"].decode(): c["pending"] for c in group.xinfo_consumers(STREAM, GROUP)}
    assert info["rescuer"] == 40 and info["ghost"] == 0


def test_reclaimer_acks_entries_deleted_while_pending(group: redis.Redis) -> None:
    ids = add(group, 3)
    deliver(group, "ghost", 3)
    group.xdel(STREAM, ids[1])
    entries = reclaimer(group).claim(10)
    assert [e.id for e in entries] == [ids[0], ids[2]]
    assert pending_count(group) == 2  # the deleted one was acked


def test_idle_consumers_are_removed_only_when_they_hold_nothing(group: redis.Redis) -> None:
    add(group, 2)
    deliver(group, "holder", 1)
    group.xreadgroup(GROUP, "empty", {STREAM: "0"})  # registers a consumer with nothing
    threading.Event().wait(0.05)
    removed = reclaimer(group, "me").remove_idle_consumers(idle_ms=10)
    assert removed == ["empty"]
    names = {c["name"].decode() for c in group.xinfo_consumers(STREAM, GROUP)}
    assert "holder" in names and "empty" not in names


def dead_letters(r: redis.Redis, consumer: str, max_deliveries: int = 2) -> DeadLetters:
    return DeadLetters(r, STREAM, GROUP, consumer, namespace="redbatch", model_name="echo",
                       max_deliveries=max_deliveries, result_ttl_ms=60_000,
                       max_payload_bytes=1 << 20)


def test_poison_entries_move_to_the_dead_letter_stream_and_requeue(group: redis.Redis) -> None:
    poison, good = add(group, 2)
    deliver(group, "w", 2)
    reader = StreamReader(group, STREAM, GROUP, "w")
    for _ in range(2):  # two more deliveries of the first entry (drain reads one at a time)
        assert [e.id for e in reader.read(1, 10)] == [poison]
    entries = [e for e in reader._xreadgroup("0", 10, None)]  # third redelivery of both
    assert [e.id for e in entries] == [poison, good] and all(e.redelivered for e in entries)
    before = counted("redeliveries"), counted("dead_letters")
    survivors = dead_letters(group, "w", max_deliveries=3).divert(entries)
    assert [e.id for e in survivors] == [good]
    assert (counted("redeliveries"), counted("dead_letters")) == (before[0] + 2, before[1] + 1)
    reply = decode_envelope(group.lpop("redbatch:reply:req0"))
    assert reply["ok"] is False and reply["error"]["code"] == "dead_letter"
    assert pending_count(group) == 1  # the poison entry was acked, the good one was not
    dead_stream = dead_letter_key("redbatch", "echo")
    [dead] = list_dead_letters(group, dead_stream, 10)
    assert dead.summary()["deliveries"] == 4 and dead.summary()["entry_id"] == poison
    assert dead.summary()["request_id"] == "req0"
    [requeued] = requeue_dead_letters(group, dead_stream, STREAM, [dead.id])
    assert group.xlen(dead_stream) == 0
    fields = group.xrange(STREAM, requeued, requeued)[0][1]
    assert fields == {b"id": b"req0", b"payload": b"\x80"}


def test_a_producers_dead_fields_neither_forge_nor_break_the_dead_letters(
        group: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry's own `dead:*` fields once followed the worker's in the dead letter, so the
    listing showed the forged error and `int("many")` stopped the command."""
    forged = {**entry_fields("req0", b"\x80"), "dead:deliveries": "many",
              "dead:error": "forged", "dead:consumer": "nobody"}
    entry_id = group.xadd(STREAM, forged).decode()  # type: ignore[arg-type]
    for start in (">", "0"):
        group.xreadgroup(GROUP, "w", {STREAM: start})
    entries = list(StreamReader(group, STREAM, GROUP, "w")._xreadgroup("0", 10, None))
    assert dead_letters(group, "w", max_deliveries=2).divert(entries) == []
    dead_stream = dead_letter_key("redbatch", "echo")
    [(_, raw)] = group.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1,
                            dead_stream)  # type: ignore[misc]  # the pairs, not a dict
    names = raw[::2]
    assert names.count(b"dead:deliveries") == names.count(b"dead:error") == 1
    [dead] = list_dead_letters(group, dead_stream, 10)
    summary = dead.summary()
    assert summary["deliveries"] == 3 and summary["consumer"] == "w"
    assert summary["entry_id"] == entry_id and "max_deliveries 2" in str(summary["error"])
    settings = load_settings(None, redis_url=redis_url, model="echo")
    assert run_dead_letters(settings, 10, [], False) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in listed] == [summary]
    [requeued] = requeue_dead_letters(group, dead_stream, STREAM, [dead.id])
    fields = group.xrange(STREAM, requeued, requeued)[0][1]
    assert fields == {b"id": b"req0", b"payload": b"\x80"}


def test_a_dead_letter_holding_forged_fields_lists_the_workers_own(group: redis.Redis) -> None:
    """One written before the copy skipped them: the first value of a name (the worker's)
    wins, and a count that is no integer is shown as unknown instead of stopping the listing."""
    dead_stream = dead_letter_key("redbatch", "echo")
    group.execute_command("XADD", dead_stream, "*", "dead:entry_id", "1-0", "dead:deliveries",
                          "4", "dead:error", "true reason", "id", "req0", "dead:error", "forged",
                          "dead:deliveries", "many")
    group.xadd(dead_stream, {"dead:deliveries": "many", "id": "req1"})
    first, second = (d.summary() for d in list_dead_letters(group, dead_stream, 10))
    assert (first["deliveries"], first["error"], first["request_id"]) == (4, "true reason",
                                                                           "req0")
    assert second["deliveries"] == "unknown" and second["request_id"] == "req1"


def test_a_claimed_entry_is_not_dead_lettered_by_its_former_owner(group: redis.Redis) -> None:
    [entry_id] = add(group, 1)
    deliver(group, "slow", 1)
    entries = reclaimer(group).claim(10)  # taken over by "rescuer"
    assert dead_letters(group, "slow", max_deliveries=1).divert(entries) == []
    assert group.xlen(dead_letter_key("redbatch", "echo")) == 0
    assert pending_count(group) == 1


def test_replier_drops_answers_when_redis_lost_the_group(group: redis.Redis) -> None:
    [entry_id] = add(group, 1)
    deliver(group, "w", 1)
    group.flushall()
    replier = Replier(group, STREAM, GROUP, "w", 60_000, "redbatch:answered:echo")
    assert replier.send([Reply(entry_id, "redbatch:reply:x", b"{}")]) == [entry_id]
    assert group.llen("redbatch:reply:x") == 0


def maintenance(r: redis.Redis) -> Maintenance:
    return Maintenance(r, STREAM, GROUP, "echo", reclaimer(r), 60, 3_600_000)


def test_trim_keeps_every_entry_some_group_has_not_acked(group: redis.Redis) -> None:
    ids = add(group, 10)
    group.xgroup_create(STREAM, "other", id="0")
    deliver(group, "w", 6)
    group.xack(STREAM, GROUP, *ids[:3], ids[4])  # ids[3] and ids[5] still pending
    other = group.xreadgroup("other", "o", {STREAM: ">"}, count=8)
    assert len(other[0][1]) == 8
    group.xack("redbatch:requests:echo", "other", *ids[:8])
    assert maintenance(group).trim() == 3  # below ids[3], the oldest pending of `workers`
    assert [e[0].decode() for e in group.xrange(STREAM)] == ids[3:]
    group.xack(STREAM, GROUP, ids[3], ids[5])
    assert maintenance(group).trim() == 3  # now below ids[6]: not yet delivered to `workers`
    deliver(group, "w", 4)
    group.xack(STREAM, GROUP, *ids[6:])
    assert maintenance(group).trim() == 2  # below ids[8]: not yet delivered to `other`
    group.xreadgroup("other", "o", {STREAM: ">"})
    assert maintenance(group).trim() == 0  # delivered, but pending
    group.xack(STREAM, "other", *ids[8:])
    assert maintenance(group).trim() == 2
    assert group.xlen(STREAM) == 0


def test_backlog_counts_pending_and_undelivered(group: redis.Redis) -> None:
    ids = add(group, 7)
    deliver(group, "w", 4)
    group.xack(STREAM, GROUP, ids[0])
    assert maintenance(group).backlog() == 6  # 3 pending + 3 undelivered


def test_producer_refuses_past_max_backlog_atomically(redis_url: str, group: redis.Redis) -> None:
    client = Client(redis_url, "echo", max_backlog=100)
    accepted, refused = [], []

    def flood() -> None:
        for i in range(40):
            try:
                accepted.append(client.submit({"i": i}))
            except Overloaded as exc:
                refused.append(exc)

    threads = [threading.Thread(target=flood) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(accepted) == 100 and len(refused) == 100
    assert group.xlen(STREAM) == 100
    assert refused[0].backlog == 100 and refused[0].max_backlog == 100
    deliver(group, "w", 10)
    group.xack(STREAM, GROUP, *[e[0] for e in group.xrange(STREAM, count=10)])
    assert len(client.submit_many([{"n": n} for n in range(10)])) == 10
    with pytest.raises(Overloaded) as caught:
        client.submit_many([{"n": n} for n in range(1500)])  # chunk 1 refused: none added
    assert caught.value.submitted == [] and group.xlen(STREAM) == 110


def test_async_producer_refuses_past_max_backlog(redis_url: str, group: redis.Redis) -> None:
    async def scenario() -> None:
        client = AsyncClient(redis_url, "echo", max_backlog=3)
        try:
            assert len(await client.submit_many([{"n": 1}, {"n": 2}])) == 2
            await client.submit({"n": 3})
            with pytest.raises(Overloaded):
                await client.submit({"n": 4})
        finally:
            await client.close()

    asyncio.run(scenario())
    assert group.xlen(STREAM) == 3


def test_backlog_limit_without_any_worker_counts_the_whole_stream(redis_url: str,
                                                                  r: redis.Redis) -> None:
    client = Client(redis_url, "echo", max_backlog=2)
    client.submit_many([{"n": 1}, {"n": 2}])
    with pytest.raises(Overloaded):
        client.submit({"n": 3})


def test_producer_cli_reports_overload(redis_url: str, group: redis.Redis, tmp_path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from producer.cli import main

    lines = tmp_path / "in.txt"
    lines.write_text("one\ntwo\nthree\n")
    announce(group, "echo")  # a live worker that reads nothing: the backlog stays full
    group.xadd(STREAM, {"id": "x", "payload": b"\x01"})
    group.xadd(STREAM, {"id": "y", "payload": b"\x01"})
    code = main([str(lines), "--model", "echo", "--redis-url", redis_url, "--max-backlog", "2",
                 "--timeout", "1", "--backlog-wait", "0.5", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and "overloaded" in err and "still full after 0.5 s" in err
    assert group.xlen(STREAM) == 2
