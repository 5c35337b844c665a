"""`python -m producer batch ...` and `python -m producer batches`: batch jobs without HTTP.

  batch create FILE --endpoint URL   upload FILE and create a batch; its object as JSON
  batch run -i IN -o OUT             create, run until final, write its output and error
                                     lines to OUT (a drop-in for `vllm run-batch` files)
  batch status ID | cancel ID | list
  batch results ID [-o OUT] [--errors]   the output (or error) lines so far
  batches                            a runner alone: runs every batch it can lease

The state lives in Redis (docs/protocol.md, "Batch jobs"), so these and the gateway's
/v1/batches see the same batches; `--api-key` names the owner, as the gateway's bearer key.
`batch create` and `batch run` run a runner of their own while they wait, so no gateway is
needed; any number of runners share the batches through their leases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from producer import connection, protocol
from producer.async_client import AsyncClient
from producer.batches import keys, objects, upload
from producer.batches.keys import holder_name
from producer.batches.runner import Runner, RunnerConfig
from producer.batches.store import READ_WINDOW, BatchStore
from producer.gateway.discovery import Discovery, ModelState
from producer.gateway.events import configure_logging
from producer.liveness import Kind
from producer.local_redis import local_url
from producer.request_base import DEFAULT_URL

POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    url = os.environ.get("REDBATCH_REDIS_URL") or local_url() or DEFAULT_URL
    parser.add_argument("--redis-url", default=url)
    parser.add_argument("--redis-cluster", action="store_true")
    parser.add_argument("--namespace", default=protocol.DEFAULT_NAMESPACE)
    parser.add_argument("--api-key", default=os.environ.get("REDBATCH_API_KEY"),
                        help="the owner of the batches, as the gateway's bearer key")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("create", "run"):
        sub = commands.add_parser(name)
        if name == "create":
            sub.add_argument("file")
            sub.add_argument("--wait", action="store_true", help="run until final")
        else:
            sub.add_argument("-i", "--input", dest="file", required=True)
            sub.add_argument("-o", "--output", required=True)
        sub.add_argument("--endpoint", default=None, help="default: the first line's url")
        sub.add_argument("--completion-window", default="24h")
    for name in ("status", "cancel", "results"):
        sub = commands.add_parser(name)
        sub.add_argument("batch_id")
        if name == "results":
            sub.add_argument("-o", "--output", default="-")
            sub.add_argument("--errors", action="store_true", help="the error lines")
    commands.add_parser("list")
    return parser


async def file_chunks(path: str) -> AsyncIterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            yield chunk


def first_url(path: str) -> str:
    with open(path, "rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    return str(json.loads(raw).get("url", ""))
                except (ValueError, AttributeError):
                    return ""
    return ""


class Session:
    """One command's Redis client, store and (while waiting) runner."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.redis = connection.async_client(args.redis_url, cluster=args.redis_cluster)
        self.store = BatchStore(self.redis, args.namespace)
        self.owner = keys.owner_of(args.api_key)
        self.clients: dict[str, AsyncClient] = {}
        self.discovery = Discovery(self.redis, args.namespace, protocol.DEFAULT_GROUP, 30.0,
                                   1.0)

    def client(self, model: str) -> AsyncClient:
        if model not in self.clients:
            self.clients[model] = AsyncClient(model=model, namespace=self.args.namespace,
                                              redis_client=self.redis)
        return self.clients[model]

    async def kind_of(self, model: str) -> tuple[bool, Kind | None]:
        info = await self.discovery.info(model)
        return info.state is not ModelState.UNKNOWN, info.kind

    def runner(self, role: str) -> Runner:
        return Runner(self.store, self.client, self.kind_of, RunnerConfig(), holder_name(role))

    async def create(self) -> dict[bytes, bytes]:
        args = self.args
        endpoint = args.endpoint or first_url(args.file)
        seconds = objects.window_seconds(args.completion_window)
        if seconds is None:
            raise SystemExit(f"batch: --completion-window {args.completion_window!r} is not "
                             "'24h' or a shorter '<n>h', '<n>m', '<n>s'")
        source = await upload.upload(self.store, file_chunks(args.file),
                                     os.path.basename(args.file), self.owner, 200 << 20,
                                     4 << 20)
        now_ms = int(time.time() * 1000)
        meta = {"id": keys.new_batch_id(), "owner": self.owner, "endpoint": endpoint,
                "input_file_id": source["id"], "completion_window": args.completion_window,
                "status": objects.VALIDATING, "created_at": now_ms // 1000,
                "created_ms": now_ms, "expires_at": now_ms // 1000 + seconds, "total": 0,
                "completed": 0, "failed": 0, "metadata": ""}
        await self.store.create(meta)
        return await self.store.batch_meta(meta["id"])

    async def wait(self, batch_id: str) -> dict[bytes, bytes]:
        """Run a runner beside the wait, until the batch is final."""
        stop = asyncio.Event()
        running = asyncio.create_task(self.runner("cli").run(stop))
        try:
            while objects.text(meta := await self.owned(batch_id), "status") not in \
                    objects.FINAL:
                print(progress(meta), file=sys.stderr)
                await asyncio.sleep(POLL_S)
        finally:
            stop.set()
            await running
        return meta

    async def owned(self, batch_id: str) -> dict[bytes, bytes]:
        meta = await self.store.batch_meta(batch_id)
        if not meta or objects.text(meta, "owner") != self.owner:
            raise SystemExit(f"batch: no batch {batch_id} (of this --api-key)")
        return meta

    async def write_lines(self, file_id: str, out: Any) -> int:
        start = 0
        while window := await self.store.read_output(file_id, start, READ_WINDOW):
            out.write(b"".join(line + b"\n" for line in window))
            start += len(window)
        return start


def progress(meta: dict[bytes, bytes]) -> str:
    counts = objects.batch_object(meta)["request_counts"]
    return (f"{objects.text(meta, 'id')}: {objects.text(meta, 'status')}, "
            f"{counts['completed']} completed, {counts['failed']} failed of {counts['total']}")


def show(meta: dict[bytes, bytes]) -> None:
    print(json.dumps(objects.batch_object(meta)))


async def command(args: argparse.Namespace) -> int:
    session = Session(args)
    try:
        return await dispatch(session, args)
    finally:
        await session.redis.aclose()


async def dispatch(session: Session, args: argparse.Namespace) -> int:
    if args.command == "list":
        ids = await session.store.page(keys.batch_index(args.namespace, session.owner), None,
                                       1000)
        for meta in await session.store.metas([session.store.keys(i).meta for i in ids]):
            print(progress(meta))
        return 0
    if args.command in ("create", "run"):
        meta = await session.create()
        if args.command == "create" and not args.wait:
            show(meta)
            return 0
        meta = await session.wait(objects.text(meta, "id") or "")
        if args.command == "create":
            show(meta)
        else:
            with open(args.output, "wb") as out:
                for name in ("output_file_id", "error_file_id"):
                    if file_id := objects.text(meta, name):
                        await session.write_lines(file_id, out)
            print(progress(meta), file=sys.stderr)
        return 0 if objects.text(meta, "status") == objects.COMPLETED else 1
    meta = await session.owned(args.batch_id)
    if args.command == "cancel":
        await session.store.cancel(args.batch_id, int(time.time()))
        meta = await session.owned(args.batch_id)
    if args.command == "results":
        kind = "errors" if args.errors else "output"
        file_id = keys.output_file_id(args.batch_id, kind)
        if args.output == "-":  # stdout stays open: the caller may write after it
            await session.write_lines(file_id, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        else:
            with open(args.output, "wb") as target:
                await session.write_lines(file_id, target)
        return 0
    show(meta)
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("warning")  # stdout is for the command's answer
    return asyncio.run(command(args))


def serve_runner(argv: list[str]) -> int:
    """`python -m producer batches`: a runner alone, until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m producer batches",
                                     description="run batch jobs (a lease per batch)")
    url = os.environ.get("REDBATCH_REDIS_URL") or local_url() or DEFAULT_URL
    parser.add_argument("--redis-url", default=url)
    parser.add_argument("--redis-cluster", action="store_true")
    parser.add_argument("--namespace", default=protocol.DEFAULT_NAMESPACE)
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    args.api_key = None
    configure_logging(args.log_level)

    async def run() -> None:
        session = Session(args)
        try:
            await session.runner("runner").run(asyncio.Event())
        finally:
            await session.redis.aclose()
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    return 0
