"""A full Redis (noeviction refuses writes) is waited out: the answer is written once it can be."""

from __future__ import annotations

import time

import redis

from producer import Client


def test_reply_waits_out_a_full_redis(redis_url: str, r: redis.Redis, worker_factory) -> None:
    client = Client(redis_url, "echo")
    with worker_factory(model="echo", model_options={"delay_ms": 600}) as worker:
        first = client.submit({"n": 1})
        time.sleep(0.2)  # read and computing: its reply comes at about 0.6 s
        r.config_set("maxmemory", 1)  # every write is now refused with OOM
        try:
            time.sleep(1.5)
            assert r.llen(client.reply_key(first)) == 0, "no write can pass while Redis is full"
        finally:
            r.config_set("maxmemory", 0)
        assert client.result(first, timeout=10) == {"n": 1}
        assert client.infer({"n": 2}, timeout=10) == {"n": 2}  # still serving
        assert not worker.failed
    assert r.xpending("redbatch:requests:echo", "workers")["pending"] == 0
    assert r.llen(client.reply_key(first)) == 0  # exactly one reply, already popped
