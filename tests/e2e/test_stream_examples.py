"""The streaming readers in examples/ (redis-cli, Node.js, Python) against a real worker
serving the tiny GPT-2 (tests/rigs/tiny_lm.py) on a real Redis: each prints the answer as it
streams, which must be the text of the unstreamed answer to the same greedy request, and
exits 1 on an error `done` entry or a timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from producer import protocol
from tests.rigs.node import npm_installed
from tests.rigs.paths import REPO_ROOT
from tests.rigs.tiny_lm import build_tiny_lm

EXAMPLES = REPO_ROOT / "examples"
QUESTION = "hello redis, what is the capital of france?"
MAX_NEW_TOKENS = 24
READERS = {  # name: (command, folder)
    "redis-cli": (["bash", "stream-redis-cli.sh"], EXAMPLES),
    "python": ([sys.executable, "stream.py"], EXAMPLES),
    "node": (["node", "stream.mjs"], EXAMPLES / "node"),
}
CASES = [("redis-cli", protocol.JSON), ("python", protocol.MSGPACK), ("python", protocol.JSON),
         ("node", protocol.MSGPACK), ("node", protocol.JSON)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-stream"))


@pytest.fixture
def tiny_worker(worker_factory: Any, tiny_path: Path) -> Iterator[Any]:
    with worker_factory(model="causal_lm", model_options={"path": str(tiny_path)}) as worker:
        yield worker


def available(reader: str) -> None:
    """Skip a reader whose tools are missing (npm ci runs once, from the lock file)."""
    if reader == "redis-cli" and not shutil.which("redis-cli"):
        pytest.skip("redis-cli is not installed")
    if reader == "node":
        npm_installed(EXAMPLES / "node", EXAMPLES / "node" / "node_modules")


def run_reader(reader: str, redis_url: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """Bytes, not text: universal newlines would turn a generated \\r into \\n."""
    available(reader)
    command, folder = READERS[reader]
    return subprocess.run([*command, QUESTION], cwd=folder, capture_output=True, timeout=60,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "REDIS_URL": redis_url,
                               "MODEL": "causal_lm", "MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
                               "TIMEOUT_S": "20", **env})


def unstreamed_text(r: redis.Redis) -> str:
    """The same greedy request with "stream": false: one envelope on the list reply key."""
    request_id = uuid.uuid4().hex
    payload = {"messages": [{"role": "user", "content": QUESTION}],
               "max_new_tokens": MAX_NEW_TOKENS, "stream": False}
    r.xadd("redbatch:requests:causal_lm", {"id": request_id, "content_type": protocol.JSON,
                                           "payload": json.dumps(payload)})
    popped: Any = r.blpop([protocol.reply_key("redbatch", request_id)], timeout=30)
    assert popped is not None, "no unstreamed reply"
    envelope = protocol.decode_envelope(popped[1])
    assert envelope["ok"], envelope
    return str(envelope["result"]["text"])


@pytest.mark.parametrize(("reader", "content_type"), CASES)
def test_a_reader_prints_the_streamed_answer(tiny_worker: Any, redis_url: str, r: redis.Redis,
                                             reader: str, content_type: str) -> None:
    done = run_reader(reader, redis_url, CONTENT_TYPE=content_type)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = unstreamed_text(r)
    assert expected  # the tiny model says something
    assert done.stdout.decode() == expected + "\n"
    streams = list(r.scan_iter("redbatch:stream:*"))
    assert len(streams) == 1 and r.xlen(streams[0]) > 2  # it did stream: deltas, then done


@pytest.mark.parametrize("reader", list(READERS))
def test_a_reader_exits_1_on_an_error_answer(tiny_worker: Any, redis_url: str,
                                             reader: str) -> None:
    done = run_reader(reader, redis_url, MAX_NEW_TOKENS="0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert b"invalid_request" in done.stderr and b"max_new_tokens" in done.stderr
    assert done.stdout.strip() == b""


@pytest.mark.parametrize("reader", list(READERS))
def test_a_reader_exits_1_when_no_answer_comes(redis_url: str, reader: str) -> None:
    """No worker serves the model: the reader gives up after TIMEOUT_S."""
    done = run_reader(reader, redis_url, MODEL="nobody", TIMEOUT_S="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert b"no answer on redbatch:stream:" in done.stderr
