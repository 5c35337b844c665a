"""End to end through a real redis-server: submit, batch, reply."""

from __future__ import annotations

from producer import Client
from producer.protocol import JSON, MSGPACK


def test_echo_roundtrip_msgpack_and_json(redis_url: str, worker_factory) -> None:
    with worker_factory(model="echo"):
        for content_type in (MSGPACK, JSON):
            client = Client(redis_url, "echo", content_type=content_type)
            payload = {"text": "héllo", "n": [1, 2, 3]}
            envelope = client.wait(client.submit(payload), timeout=10)
            assert envelope["ok"] is True
            assert envelope["result"] == payload
            assert envelope["meta"]["model"] == "echo"
            assert envelope["meta"]["batch_size"] >= 1
