"""Which Redis a worker command uses: the configured one, a running worker's embedded one in
this directory (`.redbatch/redis.url`, producer/local_redis.py), or a new embedded
redis-server whose URL is written there for the other commands to find."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from producer import local_redis
from worker.settings import Settings
from worker.streams.server import RedisServer

log = structlog.get_logger("redbatch")


@contextmanager
def redis_url(settings: Settings) -> Iterator[str]:
    """The configured Redis, a running worker's embedded one here, or a new embedded one."""
    url = settings.redis_url or local_redis.reachable_url(settings.data_dir)
    if url:  # a second worker here joins the first one's embedded Redis
        if not settings.redis_url:
            log.info("redis.local", url=url, url_file=str(local_redis.url_file(settings.data_dir)))
        yield url
        return
    with RedisServer(settings.data_dir / "redis") as server, \
            local_redis.published(server.url, settings.data_dir) as path:
        log.info("redis.embedded", url=server.url, url_file=str(path),
                 hint="set REDBATCH_REDIS_URL to use your own")
        yield server.url
