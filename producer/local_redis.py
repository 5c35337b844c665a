"""The embedded Redis a worker started without a Redis URL, found by the other commands.

`python -m worker` alone starts a redis-server on a free port and writes its URL to
`.redbatch/redis.url` (removed when it exits); the gateway and `stats`, given no URL, use
that file when it exists, so the two obvious commands meet. Otherwise they fall back to
localhost:6379 and say how to connect.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

URL_FILE_NAME = "redis.url"
DEFAULT_DIR = Path(".redbatch")  # the worker's default data_dir, relative to where it runs
FALLBACK_URL = "redis://localhost:6379/0"
HINT = ("no Redis URL given and no .redbatch/redis.url here: start `python -m worker` in this "
        "directory (it embeds Redis and writes that file), or set REDBATCH_REDIS_URL")


def url_file(directory: Path = DEFAULT_DIR) -> Path:
    return directory / URL_FILE_NAME


def local_url(directory: Path = DEFAULT_DIR) -> str | None:
    """The URL an embedded Redis wrote under `directory`, or None (no file, or empty)."""
    try:
        url = url_file(directory).read_text().strip()
    except OSError:
        return None
    return url or None


def reachable_url(directory: Path = DEFAULT_DIR) -> str | None:
    """The local embedded Redis's URL if it answers PING (a file left by a killed worker
    does not count), else None."""
    url = local_url(directory)
    if url is None:
        return None
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) as client:
            client.ping()
    except (redis.RedisError, OSError, ValueError):
        return None
    return url


def default_url() -> str:
    """What a command given no Redis URL connects to: the local embedded one, if any."""
    return local_url() or FALLBACK_URL


@contextmanager
def published(url: str, directory: Path = DEFAULT_DIR) -> Iterator[Path]:
    """Write `url` to the file for the duration of the block (atomically: a reader never
    sees half a URL), and remove it after, unless another worker has replaced it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = url_file(directory)
    temporary = path.with_name(f".{URL_FILE_NAME}.{os.getpid()}")
    temporary.write_text(url + "\n")
    temporary.replace(path)
    try:
        yield path
    finally:
        if local_url(directory) == url:
            path.unlink(missing_ok=True)
