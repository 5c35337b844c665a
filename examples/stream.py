"""A streamed answer from a generative model with plain redis-py (protocol v1,
docs/protocol.md, "Generative models"): XADD the request, then XREAD BLOCK its reply
stream until the `done` entry. Needs only `pip install redis msgpack`.

    python examples/stream.py "What is the capital of France?"
    env: REDIS_URL (redis://127.0.0.1:6379/0), MODEL (smollm2), MAX_NEW_TOKENS (48),
         CONTENT_TYPE (application/msgpack or application/json), TIMEOUT_S (60)

Prints the answer's text as it streams, then a newline; exits 1 on an error `done` entry or
when no `done` entry came within TIMEOUT_S.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import msgpack
import redis

NAMESPACE = "redbatch"


def encode(value: Any, content_type: str) -> bytes:
    if content_type == "application/json":
        return json.dumps(value).encode()
    return msgpack.packb(value)


def decode(data: bytes) -> Any:
    """An envelope is encoded like its request: a JSON one starts with `{`."""
    return json.loads(data) if data[:1] == b"{" else msgpack.unpackb(data)


def submit(r: redis.Redis, question: str, content_type: str) -> str:
    request_id = uuid.uuid4().hex
    payload = {"messages": [{"role": "user", "content": question}],
               "max_new_tokens": int(os.environ.get("MAX_NEW_TOKENS", 48))}
    r.xadd(f"{NAMESPACE}:requests:{os.environ.get('MODEL', 'smollm2')}",
           {"id": request_id, "content_type": content_type,
            "payload": encode(payload, content_type)})
    return request_id


def stream(r: redis.Redis, key: str, timeout_s: float) -> dict[str, Any]:
    """Print each delta's text as it arrives; return the `done` envelope."""
    last, deadline = "0-0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply: Any = r.xread({key: last}, count=100, block=1000)  # None after 1 s
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                envelope = decode(fields[b"data"])
                if envelope["type"] == "done":
                    return envelope
                sys.stdout.write(envelope["text"])
                sys.stdout.flush()
    raise TimeoutError(f"no answer on {key} within {timeout_s:g} s")


def main() -> int:
    question = " ".join(sys.argv[1:]) or "What is the capital of France?"
    content_type = os.environ.get("CONTENT_TYPE", "application/msgpack")
    r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    try:
        request_id = submit(r, question, content_type)
        done = stream(r, f"{NAMESPACE}:stream:{request_id}",
                      float(os.environ.get("TIMEOUT_S", 60)))
    except TimeoutError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        r.close()
    print()
    if not done["ok"]:
        print(f"error: {done['error']['code']}: {done['error']['message']}", file=sys.stderr)
        return 1
    result = done["result"]
    print(f"({result['tokens']} tokens, finish_reason {result['finish_reason']})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
