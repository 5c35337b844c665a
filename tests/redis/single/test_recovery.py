"""In-process recovery checks: fuzzed entries, stale backlog, shutdown grace, poison policy."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from producer import Client
from producer.entry_rules import EntryRules
from producer.protocol import MSGPACK, decode_envelope, encode, stream_key
from producer.request_entry import entry_fields
from tests.rigs.chaos import pending, request_ids, wait_until
from tests.rigs.plugin_models import CountingEcho
from tests.rigs.workers import loaded_model, running_worker
from worker.app import assemble_worker, connect
from worker.execution.executor import Executor, resolve_device
from worker.policy.backoff import backoff_delays
from worker.settings import load_settings
from worker.streams.dead_letters import is_poison, reply_target
from worker.streams.server import RedisServer

STREAM = stream_key("redbatch", "echo")
FIELD_NAMES = st.sampled_from([b"id", b"payload", b"content_type", b"reply_to", b"deadline_ms",
                               b"priority"]) | st.binary(min_size=1, max_size=6)
FIELD_VALUES = st.binary(max_size=40) | st.sampled_from([
    b"application/json", b"application/msgpack", b"", b"-1", b"1" * 30, b"\x92\x01\xc0",
    b"{}", b'{"a": 1}', b"\xff\xfe", STREAM.encode(), b"redbatch:reply:shared"])
RANDOM_FIELDS = st.dictionaries(FIELD_NAMES, FIELD_VALUES, min_size=1, max_size=6)
# Nearly valid requests with a field or two wrong, some replying to a key of the wrong type.
NEARLY_VALID = st.builds(
    lambda request_id, payload, reply_to, extra: {
        b"id": request_id, b"payload": payload,
        **({b"reply_to": reply_to} if reply_to else {}), **extra},
    st.binary(min_size=1, max_size=8), st.binary(max_size=16),
    st.sampled_from([b"", STREAM.encode(), b"redbatch:reply:fuzz"]),
    st.dictionaries(FIELD_NAMES, FIELD_VALUES, max_size=2))
FUZZED_ENTRIES = st.lists(RANDOM_FIELDS | NEARLY_VALID, min_size=1, max_size=8)


def test_poison_policy_and_backoff_are_bounded() -> None:
    assert not is_poison(5, max_deliveries=5) and is_poison(6, max_deliveries=5)
    delays = list(itertools.islice(backoff_delays(0.05, 2.0), 30))
    assert all(0 <= d <= 2.0 for d in delays) and max(delays[10:]) > 0.05


def test_reply_target_recovers_what_it_can() -> None:
    rules = EntryRules("redbatch", 100)
    assert reply_target(None, rules) is None
    assert reply_target({b"payload": b"x"}, rules) is None  # no id: cannot answer
    assert reply_target({b"id": b"r1", b"content_type": b"bogus"}, rules) == (
        "r1", "redbatch:reply:r1", "application/json")
    # a stream key is no list to push onto: the default reply key instead
    assert reply_target({b"id": b"r1", b"payload": b"x", b"reply_to": b"redbatch:stream:s"},
                        rules) == ("r1", "redbatch:reply:r1", "application/msgpack")


def test_fuzzed_entries_never_stop_good_requests(redis_url: str, r: redis.Redis) -> None:
    """Garbage interleaved with good requests: the good ones answered correctly, every bad
    one answered with an error or counted and acked, the worker alive throughout."""
    counter = itertools.count()
    with running_worker(redis_url, max_wait_ms=1, claim_idle_ms=500) as worker:

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.reuse, Phase.generate])  # bounded on failure
        @given(FUZZED_ENTRIES, st.integers(0, 8))
        def check(bad_entries: list[dict[bytes, bytes]], good_first: int) -> None:
            reply_key = f"redbatch:reply:good-{next(counter)}"
            good = [(f"g{next(counter)}", {"n": n}) for n in range(4)]
            pipe = r.pipeline(transaction=False)
            for position, fields in enumerate(bad_entries + [None] * len(good)):
                if fields is not None:
                    pipe.xadd(STREAM, fields)
                if position < len(good):
                    request_id, payload = good[position]
                    pipe.xadd(STREAM, entry_fields(request_id, encode(payload, MSGPACK),
                                                   reply_to=reply_key))
            pipe.execute()
            wait_until(lambda: r.llen(reply_key) == len(good), 10, "good replies")
            answers = {e["id"]: e for e in map(decode_envelope, r.lrange(reply_key, 0, -1))}
            assert {i: a["result"] for i, a in answers.items()} == dict(good)
            wait_until(lambda: not pending(r, STREAM), 10, "every entry acked")
            for fields in bad_entries:
                target = reply_target(fields, EntryRules("redbatch", 1 << 20))
                if target and r.type(target[1]) == b"list":
                    request_id = target[0]
                    assert any(decode_envelope(e)["id"] == request_id
                               for e in r.lrange(target[1], 0, -1)), fields
            assert worker.ready.is_set() and not worker.stopping.is_set()

        check()


def test_backlog_past_its_deadline_is_answered_without_compute(redis_url: str,
                                                              r: redis.Redis) -> None:
    client = Client(redis_url, "countingecho")
    reply_key = client.new_reply_key()
    expired = client.submit_many([{"late": n} for n in range(50)], reply_to=reply_key,
                                 deadline_ms=int(time.time() * 1000) + 200)
    fresh = client.submit_many([{"n": n} for n in range(5)], reply_to=reply_key)
    time.sleep(0.3)  # the backlog outlives its deadline before any worker reads it
    CountingEcho.computed.clear()
    with running_worker(redis_url, model="tests.rigs.plugin_models:CountingEcho"):
        envelopes = client.collect(reply_key, len(expired) + len(fresh), timeout=20)
    by_id = {e["id"]: e for e in envelopes}
    assert all(by_id[i]["error"]["code"] == "deadline_exceeded" for i in expired)
    assert all(by_id[i]["ok"] for i in fresh)
    assert CountingEcho.computed == [{"n": n} for n in range(5)]  # none of the expired ran


def test_stop_gives_up_on_a_dead_redis_after_the_grace(tmp_path: Path,
                                                      redis_server: RedisServer) -> None:
    """Redis gone at shutdown: stop computing and retrying once the grace has passed; what
    is held stays pending, never acked without its answer."""
    server = RedisServer(tmp_path / "redis", binary=redis_server.binary,
                         appendfsync="always").start()
    grace_s = 1.5
    try:
        client = Client(server.url, "echo")
        client.submit_many([{"n": n} for n in range(40)])
        settings = load_settings(None, redis_url=server.url, model="echo", metrics_port=0,
                                 model_options={"delay_ms": 400}, max_batch_size=4,
                                 shutdown_grace_s=grace_s)
        model = loaded_model("echo", settings.model_options)
        worker = assemble_worker(settings, model, Executor(model, resolve_device("cpu")),
                        connect(server.url, settings.block_ms))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        wait_until(lambda: len(worker.inflight.held) >= 20, 10, "entries held")
        server.kill()
        worker.stop()
        thread.join(grace_s + 5)  # it gave up (retrying a dead Redis would go on forever)
        assert not thread.is_alive()
        server.start()
        r = redis.Redis.from_url(server.url)
        left = pending(r, STREAM)
        assert len(left) >= 20 - 4  # at most the batch running at the kill got answered
        assert not any(r.exists(client.reply_key(i)) for i in request_ids(r, STREAM, left))
    finally:
        server.stop()


def test_worker_recreates_the_group_after_redis_lost_it(redis_url: str, r: redis.Redis) -> None:
    client = Client(redis_url, "echo")
    with running_worker(redis_url, block_ms=200):
        assert client.infer({"n": 1}, timeout=10) == {"n": 1}
        r.flushall()  # as after a restart without persistence: stream and group gone
        assert client.infer({"n": 2}, timeout=10) == {"n": 2}
        assert r.xinfo_groups(STREAM)[0]["name"] == b"workers"
