"""The ACLs of docs/deploy.md ("Security") hold on a real Redis: a worker and a producer run
under them, and the producer cannot touch the worker's own keys or anyone else's."""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from producer import Client
from tests.rigs.paths import REPO_ROOT
from tests.rigs.workers import running_worker

DEPLOY = REPO_ROOT / "docs" / "deploy.md"


def acl_commands() -> list[list[str]]:
    """Each `ACL SETUSER ...` of the Security section, its continuation lines joined."""
    section = DEPLOY.read_text().split("### ACLs", 1)[1].split("```", 2)[1]
    joined = re.sub(r"\\\n\s*", " ", section)
    return [shlex.split(line) for line in joined.splitlines() if line.startswith("ACL SETUSER")]


def as_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


@pytest.fixture
def acl_users(redis_url: str, r: redis.Redis) -> dict[str, str]:
    commands = acl_commands()
    assert {c[2] for c in commands} == {"producer", "worker"}
    for command in commands:
        r.execute_command(*command)
    yield {"producer": as_user(redis_url, "producer", "producer-secret"),
           "worker": as_user(redis_url, "worker", "worker-secret")}
    r.execute_command("ACL", "DELUSER", "producer", "worker")


def test_a_worker_and_a_producer_serve_under_the_documented_acls(
        acl_users: dict[str, str]) -> None:
    with running_worker(acl_users["worker"], model="echo") as worker:
        client = Client(acl_users["producer"], model="echo")
        assert client.infer({"n": 1}, timeout=10) == {"n": 1}
        assert client.submit_many([1, 2, 3]) and not worker.failed
        client.close()


@pytest.mark.parametrize("write", [
    lambda c: c.lpush("redbatch:answered:echo", "squat"),
    lambda c: c.hset("redbatch:workers:echo", "x", "y"),
    lambda c: c.delete("app:sessions"),
    lambda c: c.xgroup_destroy("redbatch:requests:echo", "workers"),
    lambda c: c.flushall(),
])
def test_the_producer_acl_refuses_writes_outside_its_keys(acl_users: dict[str, str],
                                                          write: object) -> None:
    producer = redis.Redis.from_url(acl_users["producer"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        write(producer)  # type: ignore[operator]
    producer.close()
