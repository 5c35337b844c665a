"""`python -m worker demo --model smollm2`: a generative model's answers stream to the
terminal as they are generated, through Redis (docs/protocol.md, "Generative models").

Starts an embedded Redis (unless REDBATCH_REDIS_URL is set) and one worker process, like
the default demo; submits a few chat prompts at once (so they share decoding steps), then
reads each answer's token stream `redbatch:stream:<id>` with XREAD BLOCK, one answer after
another: the first streams live, the later ones print what they already have, then go on.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import redis

from producer import connection, protocol
from producer.request_entry import entry_fields
from worker.app import StartupError
from worker.commands.demo import settings_env, wait_until_serving
from worker.models import BUILTIN
from worker.settings import Settings
from worker.streams.target import redis_url

PROMPTS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me three tips for writing readable Python code.",
    "Explain in two sentences why batching speeds up inference.",
)
DEFAULT_MAX_NEW_TOKENS = 48
INDENT = "      "
ANSWER_TIMEOUT_S = 300.0


def is_generative(model: str) -> bool:
    """Whether `model` names a generative model class (without building or loading it);
    anything that does not resolve goes to the default demo, whose worker says why."""
    module_name, _, class_name = BUILTIN.get(model, model).partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return False
    return bool(getattr(cls, "generative", False))


@dataclass
class Streamed:
    """One answer as read from its token stream."""

    chunks: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def submit(client: Any, stream: str, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Every prompt in one pipelined round trip, so the worker batches them together."""
    ids = [f"demo-{uuid.uuid4().hex[:12]}" for _ in prompts]
    pipe = client.pipeline()
    for request_id, prompt in zip(ids, prompts, strict=True):
        payload = {"messages": [{"role": "user", "content": prompt}],
                   "max_new_tokens": max_new_tokens}
        pipe.xadd(stream, entry_fields(
            request_id, protocol.encode(payload, protocol.MSGPACK)))
    pipe.execute()
    return ids


def read_stream(client: Any, key: str, timeout_s: float) -> Iterator[dict[str, Any]]:
    """The envelopes of one reply stream in order, from 0-0 until its `done` entry."""
    last, deadline = "0-0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, entries in client.xread({key: last}, count=100, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                envelope = _decode(fields)
                yield envelope
                if envelope.get("type") == "done":
                    return
    raise TimeoutError(f"no answer on {key} within {timeout_s:.0f} s")


def _decode(fields: dict[bytes, bytes]) -> dict[str, Any]:
    data = fields[b"data"]
    return protocol.decode(data, protocol.JSON if data[:1] == b"{" else protocol.MSGPACK)


def stream_answer(client: Any, key: str, out: TextIO,
                  timeout_s: float = ANSWER_TIMEOUT_S) -> Streamed:
    """Print each delta as it arrives (continuation lines indented); return the answer."""
    answer = Streamed()
    out.write(INDENT)
    try:
        for envelope in read_stream(client, key, timeout_s):
            if envelope.get("type") == "delta":
                answer.chunks.append(envelope["text"])
                out.write(envelope["text"].replace("\n", "\n" + INDENT))
                out.flush()
            else:
                answer.done = envelope
    finally:
        out.write("\n")
    return answer


def describe(answer: Streamed) -> tuple[bool, str]:
    """(ok, the line under an answer): its tokens, chunks, time to first token, finish."""
    done = answer.done or {}
    if not done.get("ok"):
        error = done.get("error", {})
        return False, f"failed: {error.get('code')}: {error.get('message')}"
    result, meta = done["result"], done.get("meta", {})
    if result["text"] != answer.text:
        return False, "failed: the streamed text differs from the done entry's text"
    ttft = meta.get("ttft_ms")
    first = f"first token after {ttft:.0f} ms, " if ttft is not None else ""
    seconds = (meta.get("queue_ms", 0) + meta.get("compute_ms", 0)) / 1000
    return True, (f"{result['tokens']} tokens in {len(answer.chunks)} chunks; {first}"
                  f"{seconds:.2f} s in all (finish: {result['finish_reason']})")


def stream_all(client: Any, settings: Settings, prompts: list[str],
               max_new_tokens: int) -> int:
    """Submit the prompts, print the answers one after another; the exit status."""
    out = sys.stdout
    started = time.monotonic()
    ids = submit(client, protocol.stream_key(settings.namespace, settings.model_name),
                 prompts, max_new_tokens)
    failed = tokens = 0
    for n, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True), 1):
        out.write(f"\n[{n}/{len(prompts)}] {prompt}\n")
        key = protocol.token_stream_key(settings.namespace, request_id)
        try:
            answer = stream_answer(client, key, out)
            ok, line = describe(answer)
        except TimeoutError as exc:
            ok, line = False, f"failed: {exc}"
        out.write(f"{INDENT}-- {line}\n")
        failed += not ok
        tokens += answer.done["result"]["tokens"] if ok and answer.done else 0
    elapsed = time.monotonic() - started
    out.write(f"\n{len(prompts)} answers, {failed} failed: {tokens} tokens in {elapsed:.1f} s "
              f"({tokens / elapsed:.1f} tokens/s), generated together by continuous "
              "batching with one worker process\n")
    out.flush()
    return 1 if failed else 0


def demo_prompts(prompts_file: Path | None, count: int) -> list[str]:
    """The built-in questions, or one per line of `prompts_file`; at most `count`."""
    if prompts_file is None:
        return list(PROMPTS[:count])
    try:
        lines = prompts_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise StartupError(f"cannot read prompts: {exc}") from None
    return [line.strip() for line in lines if line.strip()][:count]


def run_generate_demo(settings: Settings, prompts_file: Path | None = None, count: int = 300,
                      max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    prompts = demo_prompts(prompts_file, count)
    if not prompts:
        raise StartupError("no prompts to answer")
    with redis_url(settings) as url:
        consumer = f"demo-{os.getpid()}"
        worker = subprocess.Popen([sys.executable, "-m", "worker", "run"],
                                  env=settings_env(settings, url, consumer))
        client = connection.sync_client(url, settings.redis_cluster, socket_timeout=30,
                                        password=settings.redis_secret)
        try:
            print(f"Waiting for the {settings.model} worker to load its model...", flush=True)
            wait_until_serving(client, protocol.stream_key(settings.namespace,
                                                           settings.model_name),
                               settings.group, consumer, worker)
            print(f"Streaming {len(prompts)} answers (at most {max_new_tokens} tokens each) "
                  f"through {connection.redacted(url)}", flush=True)
            return stream_all(client, settings, prompts, max_new_tokens)
        except redis.RedisError as exc:
            raise StartupError(f"Redis failed during the demo: {exc}") from None
        finally:
            stop(worker)
            client.close()


def stop(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as the default demo does; SIGKILL if it has not stopped within a minute."""
    worker.terminate()
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
