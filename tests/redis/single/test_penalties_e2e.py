"""The penalty fields in a plain-Redis payload (docs/protocol.md): a real Redis, a real
worker on the tiny GPT-2, steps in turn and overlapped."""

from __future__ import annotations

from typing import Any

import redis

from tests.redis.single.test_generation_e2e import (  # noqa: F401
    read_stream,
    send,
    stream_key,
    tiny_path,
    tiny_worker,
)


def test_a_biased_and_penalised_payload_streams_the_biased_token(
        tiny_worker: Any, r: redis.Redis) -> None:  # noqa: F811
    request = send(r, {"prompt": "hello", "max_new_tokens": 6, "logit_bias": {"42": 100},
                       "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 6})
    entries = read_stream(r, stream_key(request))
    done = entries[-1][1]
    assert done["ok"] and done["result"]["tokens"] == 6, done
    assert [t for _, e in entries[:-1] for t in e["token_ids"]] == [42] * 6


def test_bad_penalty_fields_are_invalid_request_naming_the_field(
        tiny_worker: Any, r: redis.Redis) -> None:  # noqa: F811
    bad = {"logit_bias": {str(i): 1 for i in range(10_000)}, "frequency_penalty": 3,
           "repetition_penalty": -1, "min_tokens": "5"}
    for field, value in bad.items():
        [(_, done)] = read_stream(r, stream_key(send(r, {"prompt": "hi", field: value})))
        assert done["error"]["code"] == "invalid_request", done
        assert done["error"]["field"] == field, done
