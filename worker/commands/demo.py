"""`python -m worker demo`: real texts become real embeddings through Redis, in one command.

Starts an embedded Redis (unless REDBATCH_REDIS_URL is set), one worker process, and the
producer; prints a few results, a nearest-neighbour query, and the throughput.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from producer import connection
from producer.batch import run_requests
from producer.client import Client
from worker.app import StartupError
from worker.settings import Settings, exported
from worker.streams.target import redis_url

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sentences.txt"
QUERIES = ("How do I read a compressed file?", "Run a function in another thread.")


def settings_env(settings: Settings, url: str, consumer: str) -> dict[str, str]:
    """The demo's settings handed to the worker process as REDBATCH_* variables."""
    env = dict(os.environ)  # unset optional settings keep their defaults
    env.update({f"REDBATCH_{name.upper()}": text for name, text in exported(settings).items()})
    env.update(settings.sources.environment_for_children())  # its messages name the user's
    env["REDBATCH_REDIS_URL"] = url
    env["REDBATCH_CONSUMER"] = consumer
    return env


def wait_until_serving(client: redis.Redis, stream: str, group: str, consumer: str,
                       process: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    """A worker joins the group with its first read, which comes after the model is loaded.
    (The embedded Redis keeps its data, so the group may hold consumers of earlier runs.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StartupError(f"the worker exited with status {process.returncode}")
        try:
            if any(c["name"] in (consumer, consumer.encode())
                   for c in client.xinfo_consumers(stream, group)):
                return
        except redis.ResponseError:
            pass  # the group does not exist yet
        time.sleep(0.2)
    raise StartupError(f"the worker was not serving after {timeout_s:.0f} s")


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # embeddings are L2-normalised


def show_results(texts: list[str], envelopes: list[dict[str, Any]], client: Client) -> None:
    print("\nFirst results:")
    for text, envelope in list(zip(texts, envelopes, strict=True))[:3]:
        result, meta = envelope.get("result"), envelope.get("meta", {})
        if isinstance(result, dict) and "embedding" in result:
            head = ", ".join(f"{x:+.4f}" for x in result["embedding"][:4])
            shown = f"{result['tokens']} tokens -> [{head}, ...] ({len(result['embedding'])} dims)"
        else:
            shown = json.dumps(result)[:80]
        print(f"  {text[:60]!r}\n    {shown}; batch of {meta.get('batch_size')}, "
              f"bucket {meta.get('bucket')}, queued {meta.get('queue_ms', 0):.0f} ms")
    good = [(t, e["result"]) for t, e in zip(texts, envelopes, strict=True) if e["ok"]]
    if good and isinstance(good[0][1], dict) and "embedding" in good[0][1]:
        print("\nNearest sample to a query (cosine similarity):")
        for query in QUERIES:
            vector = client.infer({"text": query}, timeout=60)["embedding"]
            score, text = max((cosine(vector, r["embedding"]), t) for t, r in good)
            print(f"  {query!r}\n    {score:.3f}  {text[:90]!r}")


def describe_batches(envelopes: list[dict[str, Any]]) -> str:
    metas = [e["meta"] for e in envelopes if e["ok"]]
    if not metas:
        return "no successful batches"
    mean_batch = sum(m["batch_size"] for m in metas) / len(metas)
    real = sum(e["result"].get("tokens", 0) for e in envelopes
               if e["ok"] and isinstance(e["result"], dict))
    padded = sum(m.get("padded_length", 0) for m in metas)
    efficiency = f", padding efficiency {real / padded:.0%}" if real and padded else ""
    return f"mean batch size {mean_batch:.1f}{efficiency}"


def run_demo(settings: Settings, sentences: Path | None, count: int) -> int:
    source = sentences or SAMPLE
    try:
        texts = [line.strip() for line in source.read_text(encoding="utf-8").splitlines()
                 if line.strip()][:count]
    except OSError as exc:
        raise StartupError(f"cannot read sample texts: {exc}") from None
    with redis_url(settings) as url:
        consumer = f"demo-{os.getpid()}"
        worker = subprocess.Popen([sys.executable, "-m", "worker", "run"],
                                  env=settings_env(settings, url, consumer))
        try:
            client = Client(url, settings.model_name, namespace=settings.namespace,
                            redis_client=connection.sync_client(
                                url, settings.redis_cluster, password=settings.redis_secret))
            print(f"Waiting for the {settings.model} worker to load its model...", flush=True)
            wait_until_serving(client.redis, client.stream_key, settings.group, consumer, worker)
            print(f"Embedding {len(texts)} texts from {source.name} through "
                  f"{connection.redacted(url)}", flush=True)
            summary = run_requests(client, [{"text": t} for t in texts], timeout=600,
                                   progress=sys.stderr.isatty())
            show_results(texts, summary.envelopes, client)
            print(f"\n{summary.describe()} with one worker process; "
                  f"{describe_batches(summary.envelopes)}")
            return 1 if summary.failed else 0
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
