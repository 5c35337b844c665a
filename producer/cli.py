"""`python -m producer`: JSONL (or plain text lines) in, results as JSONL in input order out.

`python -m producer serve ...` runs the OpenAI-compatible HTTP gateway instead
(`python -m producer serve --help`).

Requests go through a sliding window (--window in flight at most), and each result is
written as soon as it and those before it are in, with the input's `line` number; a JSON
line's own `id` is its request id. Plain lines become {"prompt": line} for a generative
model, {"text": line} otherwise. The model must have a live worker (--wait-for-worker to
wait for one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import IO, Any, TextIO

import redis
from tqdm import tqdm

from producer import protocol
from producer.batch import BacklogFull, Item, RunSummary, Window
from producer.batch_input import InputError, check_input, open_input, read_lines, request_payload
from producer.client import Client
from producer.connection import ConnectionSettingsError, redacted
from producer.errors import Overloaded
from producer.local_redis import local_url
from producer.models import LiveModel, live_models
from producer.request_base import DEFAULT_URL, new_request_id

WORKER_POLL_S = 0.2


USAGE = """python -m producer [options] [input]      send a file's lines, write results
       python -m producer serve [options]        run the HTTP gateway (serve --help)
       python -m producer batch COMMAND ...      batch jobs in Redis (batch --help)
       python -m producer batches [options]      run batch jobs (a runner alone)"""
COMMANDS_EPILOG = """commands:
  (none)   send the input's lines as requests, write the results as JSONL (this help)
  serve    the OpenAI-compatible HTTP gateway: /v1/embeddings, /v1/chat/completions, ...
           (`python -m producer serve --help` lists its flags)
  batch    OpenAI batch jobs without HTTP: create, run, status, cancel, results, list
  batches  a batch runner alone (every gateway runs one too)"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default, unless its help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: {action.default})".strip()


def default_model() -> str:
    """$REDBATCH_MODEL_NAME, else the name the worker derives from $REDBATCH_MODEL."""
    return os.environ.get("REDBATCH_MODEL_NAME") or os.environ.get(
        "REDBATCH_MODEL", "minilm").rpartition(":")[2].lower()


def sources(argv: list[str], has_local_url: bool) -> dict[str, str]:
    """Where --model and --redis-url came from, for messages that name them: the flag, the
    environment, a local worker's .redbatch/redis.url, or the default."""
    given = {arg.split("=")[0] for arg in argv}
    env = os.environ
    model = ("--model (flag)" if "--model" in given else
             "REDBATCH_MODEL_NAME (environment)" if env.get("REDBATCH_MODEL_NAME") else
             "REDBATCH_MODEL (environment)" if env.get("REDBATCH_MODEL") else "the default")
    url = ("--redis-url (flag)" if "--redis-url" in given else
           "REDBATCH_REDIS_URL (environment)" if env.get("REDBATCH_REDIS_URL") else
           ".redbatch/redis.url (a local worker's embedded Redis)" if has_local_url else
           "the default")
    return {"model": model, "url": url}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer", description=__doc__,
                                     usage=USAGE, epilog=COMMANDS_EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("input", nargs="?", default="-", help="file, or - for stdin (default)")
    parser.add_argument("-o", "--output", default="-", help="results file (default stdout)")
    model = default_model()
    parser.add_argument("--model", default=model, help="the model's stream name (default: "
                        "$REDBATCH_MODEL_NAME, else as the worker derives it from "
                        f"$REDBATCH_MODEL, else minilm; now {model})")
    url = os.environ.get("REDBATCH_REDIS_URL") or local_url() or DEFAULT_URL
    parser.add_argument("--redis-url", default=url,  # a worker's embedded Redis, if here
                        help="redis://, rediss:// (TLS), redis+sentinel://host:port[,...]/"
                        "service[/db] or rediss+sentinel:// (default: $REDBATCH_REDIS_URL, "
                        f"else a local worker's .redbatch/redis.url, else {DEFAULT_URL}; "
                        f"now {redacted(url)})")
    parser.add_argument("--redis-cluster", action="store_true",
                        default=os.environ.get("REDBATCH_REDIS_CLUSTER", "") in ("1", "true"),
                        help="--redis-url is a seed node of a Redis Cluster")
    parser.add_argument("--replicas-to-wait", type=int,
                        default=int(os.environ.get("REDBATCH_REPLICAS_TO_WAIT", "-1")),
                        help="WAIT for this many replicas after each XADD, resubmitting "
                        "(idempotently) when short; -1: 1 where the master has one; 0: off"),
    parser.add_argument("--namespace", default=protocol.DEFAULT_NAMESPACE,
                        help="every key's prefix, as the worker's --namespace")
    parser.add_argument("--json", action="store_true", help="send JSON instead of msgpack")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each request may wait for its reply once sent")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--window", type=int, default=1000,
                        help="requests in flight at most (sent, result not yet written)")
    parser.add_argument("--max-backlog", type=int, default=None,
                        help="send only while the group's backlog stays under this; wait "
                        "while it is full")
    parser.add_argument("--backlog-wait", type=float, default=300.0,
                        help="seconds to wait for room under --max-backlog before giving up")
    parser.add_argument("--wait-for-worker", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long for a live worker of --model (default: none "
                        "live is an error)")
    return parser


def find_worker(client: Client, model: str, wait_s: float) -> LiveModel | str:
    """The model's live entry, or the one-line error naming the models that are live."""
    deadline = time.monotonic() + wait_s
    while True:
        live = live_models(client.redis, client.namespace)
        if model in live:
            return live[model]
        if time.monotonic() >= deadline:
            break
        time.sleep(WORKER_POLL_S)
    waited = f" after waiting {wait_s:g} s" if wait_s else ""
    names = ", ".join(f"{m.name} ({m.kind})" for m in live.values()) or "none"
    return f"no live worker serves model {model!r}{waited}; models with a live worker: {names}"


def items(handle: IO[str], generative: bool) -> Iterator[Item]:
    """The requests of the input, in order."""
    for line in read_lines(handle):
        yield Item(line.request_id or new_request_id(), request_payload(line, generative),
                   {"line": line.number})


def write_result(out: TextIO, summary: RunSummary, bar: Any) -> Any:
    """The callback that writes one envelope as a JSONL line."""
    def emit(envelope: dict[str, Any]) -> None:
        out.write(json.dumps(envelope, ensure_ascii=False) + "\n")
        summary.count += 1
        summary.failed += not envelope["ok"]
        bar.update()
        if not summary.count % 100:
            out.flush()
    return emit


def run(client: Client, args: argparse.Namespace, handle: IO[str], count: int,
        generative: bool) -> RunSummary:
    """Send the input through the window, writing results as they come."""
    summary, started = RunSummary(), time.perf_counter()
    progress = not args.no_progress and sys.stderr.isatty()
    with ExitStack() as stack:
        out = sys.stdout if args.output == "-" else stack.enter_context(
            open(args.output, "w", encoding="utf-8"))
        bar = stack.enter_context(tqdm(total=count, disable=not progress, unit="req",
                                       file=sys.stderr))
        window = Window(client, args.window, args.timeout, args.backlog_wait)
        window.run(items(handle, generative), write_result(out, summary, bar))
        out.flush()
    summary.seconds = time.perf_counter() - started
    return summary


def checked_input(path: str) -> tuple[IO[str], int]:
    handle = open_input(path)
    try:
        count = check_input(handle)
    except BaseException:
        handle.close()
        raise
    handle.seek(0)
    return handle, count


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the OpenAI-compatible HTTP gateway (producer/gateway/)
        from producer.gateway.serve import main as serve

        return serve(argv[1:])
    if argv[:1] in (["batch"], ["batches"]):  # batch jobs (producer/batches/)
        from producer.batches import cli as batch_cli

        return batch_cli.main(argv[1:]) if argv[0] == "batch" else \
            batch_cli.serve_runner(argv[1:])
    args = build_parser().parse_args(argv)
    args.sources = sources(argv, local_url() is not None)
    if args.window < 1:
        print("producer: --window must be at least 1", file=sys.stderr)
        return 2
    try:
        handle, count = checked_input(args.input)
    except (OSError, UnicodeDecodeError, InputError) as exc:
        print(f"producer: cannot read input: {exc}", file=sys.stderr)
        return 2
    with handle:
        return send(args, handle, count)


def send(args: argparse.Namespace, handle: IO[str], count: int) -> int:
    """Connect, find a live worker, run; the exit status."""
    content_type = protocol.JSON if args.json else protocol.MSGPACK
    try:
        client = Client(args.redis_url, args.model, namespace=args.namespace,
                        content_type=content_type, max_backlog=args.max_backlog,
                        cluster=args.redis_cluster, replicas_to_wait=args.replicas_to_wait)
    except ConnectionSettingsError as exc:
        print(f"producer: {exc}", file=sys.stderr)
        return 2
    try:
        found = find_worker(client, args.model, args.wait_for_worker)
        if isinstance(found, str):
            print(f"producer: {found} [--model from {args.sources['model']}; Redis "
                  f"{redacted(args.redis_url)} from {args.sources['url']}]", file=sys.stderr)
            return 2
        summary = run(client, args, handle, count, bool(found.generative))
    except (Overloaded, BacklogFull) as exc:
        print(f"producer: overloaded: {exc}", file=sys.stderr)
        return 3
    except redis.RedisError as exc:
        print(f"producer: Redis error at {redacted(args.redis_url)}: {exc} [--redis-url from "
              f"{args.sources['url']}]", file=sys.stderr)
        return 2
    print(summary.describe(), file=sys.stderr)
    return 1 if summary.failed else 0
