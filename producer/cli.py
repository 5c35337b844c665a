"""`python -m producer`: JSONL (or plain text lines) in, results as JSONL in input order out."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import redis
from tqdm import tqdm

from producer import protocol
from producer.client import DEFAULT_URL, Client, Overloaded
from producer.connection import ConnectionSettingsError, redacted


class InputError(Exception):
    """A line of the input could not be read; the message names it."""


def parse_lines(lines: Iterable[str]) -> list[Any]:
    """JSON objects as they are; any other non-blank line becomes {"text": line}."""
    payloads: list[Any] = []
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.lstrip().startswith("{"):
            try:
                payloads.append(json.loads(text))
            except json.JSONDecodeError as exc:
                raise InputError(f"line {number}: invalid JSON ({exc.msg})") from None
        else:
            payloads.append({"text": text})
    return payloads


@dataclass
class RunSummary:
    envelopes: list[dict[str, Any]]  # in input order
    seconds: float

    @property
    def failed(self) -> int:
        return sum(1 for e in self.envelopes if not e["ok"])

    @property
    def throughput(self) -> float:
        return len(self.envelopes) / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        return (f"{len(self.envelopes)} requests, {self.failed} failed, "
                f"{self.seconds:.2f} s, {self.throughput:.1f} requests/s")


def run_requests(client: Client, payloads: list[Any], timeout: float,
                 progress: bool = True) -> RunSummary:
    """Enqueue everything pipelined on one shared reply key, then wait for every reply."""
    started = time.perf_counter()
    reply_to = client.new_reply_key()
    ids = client.submit_many(payloads, reply_to=reply_to)
    with tqdm(total=len(ids), disable=not progress, unit="req", file=sys.stderr) as bar:
        received = client.collect(reply_to, len(ids), timeout, on_reply=lambda _: bar.update(),
                                  ids=set(ids))
    seconds = time.perf_counter() - started
    client.redis.delete(reply_to)
    by_id = {envelope["id"]: envelope for envelope in received}
    envelopes = [by_id.get(request_id) or protocol.error_envelope(
        request_id, "timeout", f"no reply within {timeout} s") for request_id in ids]
    return RunSummary(envelopes, seconds)


def write_jsonl(envelopes: Iterable[dict[str, Any]], out: TextIO) -> None:
    for envelope in envelopes:
        out.write(json.dumps(envelope, ensure_ascii=False) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer", description=__doc__)
    parser.add_argument("input", nargs="?", default="-", help="file, or - for stdin (default)")
    parser.add_argument("-o", "--output", default="-", help="results file (default stdout)")
    parser.add_argument("--model", default=os.environ.get("REDBATCH_MODEL_NAME", "minilm"))
    parser.add_argument("--redis-url", default=os.environ.get("REDBATCH_REDIS_URL", DEFAULT_URL),
                        help="redis://, rediss:// (TLS), redis+sentinel://host:port[,...]/"
                        "service[/db] or rediss+sentinel://")
    parser.add_argument("--redis-cluster", action="store_true",
                        default=os.environ.get("REDBATCH_REDIS_CLUSTER", "") in ("1", "true"),
                        help="--redis-url is a seed node of a Redis Cluster")
    parser.add_argument("--replicas-to-wait", type=int,
                        default=int(os.environ.get("REDBATCH_REPLICAS_TO_WAIT", "-1")),
                        help="WAIT for this many replicas after each XADD, resubmitting "
                        "(idempotently) when short; -1: 1 where the master has one; 0: off"),
    parser.add_argument("--namespace", default=protocol.DEFAULT_NAMESPACE)
    parser.add_argument("--json", action="store_true", help="send JSON instead of msgpack")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for all replies")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--max-backlog", type=int, default=None,
                        help="refuse to enqueue when the group's backlog would pass this")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the OpenAI-compatible HTTP gateway (producer/gateway/)
        from producer.gateway.serve import main as serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.input == "-":
            payloads = parse_lines(sys.stdin)
        else:
            with open(args.input, encoding="utf-8") as handle:
                payloads = parse_lines(handle)
    except (OSError, UnicodeDecodeError, InputError) as exc:
        print(f"producer: cannot read input: {exc}", file=sys.stderr)
        return 2
    content_type = protocol.JSON if args.json else protocol.MSGPACK
    try:
        client = Client(args.redis_url, args.model, namespace=args.namespace,
                        content_type=content_type, max_backlog=args.max_backlog,
                        cluster=args.redis_cluster, replicas_to_wait=args.replicas_to_wait)
    except ConnectionSettingsError as exc:
        print(f"producer: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_requests(client, payloads, args.timeout,
                               progress=not args.no_progress and sys.stderr.isatty())
    except Overloaded as exc:
        print(f"producer: overloaded: {exc}", file=sys.stderr)
        return 3
    except redis.RedisError as exc:
        print(f"producer: Redis error at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        write_jsonl(summary.envelopes, sys.stdout)
    else:
        with Path(args.output).open("w", encoding="utf-8") as out:
            write_jsonl(summary.envelopes, out)
    print(summary.describe(), file=sys.stderr)
    return 1 if summary.failed else 0
