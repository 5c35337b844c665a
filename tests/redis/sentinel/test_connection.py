"""Connecting (producer/connection.py): URL forms, one-line errors, Sentinel, TLS, Cluster.

The Sentinel, TLS and Cluster cases run real servers (Debian's Redis 7, or REDIS_SERVER when
it is 7+) started by fixtures in conftest.py; they skip when no Redis 7 is installed.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from producer import AsyncClient, Client, cli
from producer.backlog import ADD_ONCE, add_once_arguments, submitted_key
from producer.connection import (
    ConnectionSettingsError,
    async_client,
    parse_target,
    redacted,
    sync_client,
)
from producer.replicas import ReplicaCount
from tests.rigs.sentinel import SentinelRig, sentinel_rig
from tests.rigs.servers import RedisNode, TlsFiles, wait_until
from tests.rigs.workers import running_worker
from worker.app import StartupError, connect
from worker.settings import load_settings
from worker.streams.server import RedisServer


def test_sentinel_url_is_read_whole() -> None:
    target = parse_target("redis+sentinel://me:s%40cret@h1:5000,h2/svc/3?socket_timeout=2.5")
    assert (target.mode, target.tls, target.service) == ("sentinel", False, "svc")
    assert target.sentinels == (("h1", 5000), ("h2", 26379))
    assert target.options == {"db": 3, "socket_timeout": 2.5, "username": "me",
                              "password": "s@cret"}
    assert parse_target("rediss+sentinel://h:1/svc").tls
    assert parse_target("rediss://h:1/0").tls and parse_target("redis://h", cluster=True).mode \
        == "cluster"


@pytest.mark.parametrize(("url", "cluster", "says"), [
    ("http://h:1/0", False, "must start with one of redis://"),
    ("redis+sentinel://h:1", False, "the path must be /<service>[/<db>]"),
    ("redis+sentinel://h:1/svc/zero", False, "database 'zero' is not a number"),
    ("redis+sentinel://h:port/svc", False, "bad sentinel address 'h:port'"),
    ("redis+sentinel:///svc", False, "names no sentinel"),
    ("redis+sentinel://h:1/svc", True, "redis_cluster takes a seed node"),
    ("unix:///tmp/r.sock", True, "must start with one of redis://, rediss://"),
    ("redis://h:1/0?socket_timeout=soon", False, "Invalid value for 'socket_timeout'"),
    ("redis://h:1/0?no_such_option=1", False, "unexpected keyword argument 'no_such_option'"),
])
def test_bad_urls_give_one_clear_line(url: str, cluster: bool, says: str) -> None:
    for build in (sync_client, async_client):
        with pytest.raises(ConnectionSettingsError) as caught:
            build(url, cluster)
        assert says in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(StartupError, match="Redis URL"):
        connect(url, 100, cluster=cluster)


def test_passwords_never_shown() -> None:
    assert redacted("redis+sentinel://u:pw@h:1/s") == "redis+sentinel://u:***@h:1/s"
    assert redacted("redis+sentinel://h:1/s?socket_timeout=2&sentinel_password=pw&db=1") == \
        "redis+sentinel://h:1/s?socket_timeout=2&sentinel_password=***&db=1"
    with pytest.raises(ConnectionSettingsError) as caught:
        sync_client("redis+sentinel://u:pw@h:1/s/x")
    assert "pw" not in str(caught.value)


def test_a_password_setting_authenticates_and_a_url_password_too_is_refused(
        tmp_path: Path) -> None:
    """The separate password (any characters, no URL encoding), on a Redis that requires
    one: sync and async clients, and the worker's connect. With a password in the URL as
    well, one clear line: which would win differs between redis-py's modes."""
    password = "p@ss:w/rd #%"
    with RedisServer(tmp_path / "redis") as server:
        redis.Redis.from_url(server.url).config_set("requirepass", password)
        assert sync_client(server.url, password=password).ping()
        assert asyncio.run(async_client(server.url, password=password).ping())
        connect(server.url, 100, password=password).close()
        with pytest.raises(StartupError, match="cannot reach Redis"):
            connect(server.url, 100, attempts=1)
    for build in (sync_client, async_client):
        with pytest.raises(ConnectionSettingsError, match="not both") as caught:
            build("redis://:inurl@h:1/0", password=password)
        assert "inurl" not in str(caught.value)


def test_producer_cli_refuses_a_bad_url_in_one_line(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    assert cli.main([str(tmp_path / "in.txt"), "--redis-url", "redis+sentinel://h:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("producer: Redis URL") and "\n" not in err


def test_a_single_redis_keeps_its_keys(redis_url: str, r: redis.Redis) -> None:
    """No replica: the automatic replicas_to_wait is 0, so a submit is the plain XADD."""
    client = Client(redis_url, "echo")
    client.submit({"x": 1})
    client.submit_many([{"x": 2}, {"x": 3}])
    assert client.replicas.current() == 0
    assert r.keys("*") == [b"redbatch:requests:echo"] and r.xlen("redbatch:requests:echo") == 3
    client.close()


def test_add_once_adds_a_request_once(redis_url: str, r: redis.Redis) -> None:
    """A resubmitted request (same id) adds nothing: the marker is written by the XADD's script."""
    script = r.register_script(ADD_ONCE)
    fields = {"id": "req-1", "payload": b"\x80"}
    keys = ["redbatch:requests:echo", submitted_key("redbatch", "req-1")]
    assert script(keys=keys, args=add_once_arguments("workers", None, 60_000, [fields])) \
        == [1, 1]
    assert script(keys=keys, args=add_once_arguments("workers", None, 60_000, [fields])) \
        == [1, 0]
    assert r.xlen("redbatch:requests:echo") == 1 and 0 < r.pttl(keys[1]) <= 60_000
    # a limit counts only what would be added; a refusal adds nothing
    other = ["redbatch:requests:echo", submitted_key("redbatch", "req-2")]
    two = add_once_arguments("workers", 1, 60_000, [{"id": "req-2", "payload": b"\x80"}])
    assert script(keys=other, args=two) == [0, 1] and not r.exists(other[1])


def round_trip(url: str) -> None:
    """A worker and a producer on `url`: sync and asyncio replies come back."""
    with running_worker(url, "echo"):
        client = Client(url, "echo")
        assert client.infer({"n": 1}, timeout=10) == {"n": 1}
        ids = client.submit_many([{"n": i} for i in range(20)])
        assert [client.result(i, timeout=10) for i in ids] == [{"n": i} for i in range(20)]
        client.close()

        async def twice() -> list[object]:
            aclient = AsyncClient(url, "echo")
            try:
                return list(await asyncio.gather(aclient.infer({"a": 1}, timeout=10),
                                                 aclient.infer({"a": 2}, timeout=10)))
            finally:
                await aclient.close()

        assert asyncio.run(twice()) == [{"a": 1}, {"a": 2}]


def test_worker_and_producer_through_sentinel(sentinels: SentinelRig) -> None:
    url = sentinels.url()
    assert url.startswith("redis+sentinel://")
    round_trip(url)
    with sentinels.master.client() as master:  # it went to the master Sentinel names
        assert master.exists("redbatch:requests:echo")
        assert master.info("replication")["connected_slaves"] == 1
    # a replica is attached, so the automatic replicas_to_wait is 1: markers were written
    client = Client(url, "echo")
    client.submit({"z": 1})
    assert client.replicas.current() == 1 and client.short_waits == 0
    client.close()


def test_dead_letters_and_stats_through_sentinel(sentinels: SentinelRig,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from worker.commands.dead_letters import run_dead_letters
    from worker.commands.stats import run_stats

    settings = load_settings(None, redis_url=sentinels.url(), model="echo")
    assert run_dead_letters(settings, 10, [], False) == 0
    assert run_stats(settings, ["echo"], None, True, 0.0, sleep=lambda _: None) == 0
    assert '"model": "echo"' in capsys.readouterr().out


@pytest.fixture
def tls_redis(redis7: Path, tls_files: TlsFiles, tmp_path: Path) -> Iterator[RedisNode]:
    node = RedisNode(redis7, tmp_path / "tls", ["save \"\""], tls_files).start()
    yield node
    node.stop()


def test_tls_single_redis(tls_redis: RedisNode, tls_files: TlsFiles) -> None:
    url = f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={tls_files.ca}"
    round_trip(url)
    plain = redis.Redis(port=tls_redis.port, socket_timeout=2)  # the port speaks TLS only
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    untrusted = f"rediss://127.0.0.1:{tls_redis.port}/0"  # the test CA is not trusted
    with pytest.raises(StartupError, match="cannot reach Redis"):
        connect(untrusted, 100, attempts=1)


def test_sentinels_with_their_own_password(redis7: Path, tmp_path: Path) -> None:
    """Sentinels with requirepass (as Bitnami's chart sets them up): `sentinel_password` in
    the URL authenticates to them, and the master is reached without it."""
    secret = "s3cr&t+=/"  # URL-encoded in the query
    with sentinel_rig(redis7, tmp_path, sentinel_password=secret) as rig:
        with pytest.raises(StartupError, match="cannot reach Redis"):
            connect(rig.url(), 100, attempts=1)  # the sentinels refuse us without it
        url = f"{rig.url()}?sentinel_password={quote(secret, safe='')}"
        round_trip(url)
        with pytest.raises(ConnectionSettingsError) as caught:
            sync_client(f"{url}&no_such_option=1")
        assert "cr&t" not in str(caught.value) and "sentinel_password=***" in str(caught.value)


def test_tls_through_sentinel(redis7: Path, tls_files: TlsFiles, tmp_path: Path) -> None:
    with sentinel_rig(redis7, tmp_path, tls_files) as rig:
        url = rig.url()
        assert url.startswith("rediss+sentinel://")
        round_trip(url)


@contextmanager
def cluster(binary: Path, directory: Path,
            tls: TlsFiles | None = None) -> Iterator[list[RedisNode]]:
    """Three masters, no replicas: enough to show the cluster client connects."""
    nodes = [RedisNode(binary, directory / f"node{i}",
                       ["cluster-enabled yes", "cluster-node-timeout 2000", "save \"\"",
                        "cluster-require-full-coverage no"], tls).start() for i in range(3)]
    try:
        tls_args = ["--tls", "--cacert", str(tls.ca)] if tls else []
        subprocess.run(["redis-cli", *tls_args, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=30)

        def ok() -> bool:
            return all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes)

        wait_until(ok, 20, "the cluster did not come up")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_cluster_mode_connects_through_a_seed(redis7: Path, tls_files: TlsFiles,
                                              tmp_path: Path, tls: bool,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    if not subprocess.run(["which", "redis-cli"], capture_output=True).returncode == 0:
        pytest.skip("needs redis-cli")
    with cluster(redis7, tmp_path, tls_files if tls else None) as nodes:
        scheme, query = ("rediss", f"?ssl_ca_certs={tls_files.ca}") if tls else ("redis", "")
        url = f"{scheme}://127.0.0.1:{nodes[1].port}/0{query}"
        client = connect(url, 100, cluster=True)
        assert isinstance(client, redis.RedisCluster) and len(client.get_primaries()) == 3
        producer = Client(url, "echo", cluster=True)
        producer.submit({"a": 1})  # onto one of the model's shards (2 x 3 masters)
        assert producer.cycle is not None and producer.cycle.count == 6
        assert producer.replicas.count(producer.redis) == 0  # WAITs go to a node's client
        assert sum(client.xlen(f"redbatch:requests:{{echo:{s}}}") for s in range(6)) == 1
        assert not client.exists("redbatch:requests:echo")
        settings = load_settings(None, redis_url=url, redis_cluster=True, model="echo")
        from worker.commands.stats import run_stats

        assert run_stats(settings, None, None, True, 0.0, sleep=lambda _: None) == 0
        assert '"model": "echo", "length": 1' in capsys.readouterr().out
        from tests.rigs.cluster import cluster_worker

        with cluster_worker(url):  # the sharded worker, over TLS too
            assert producer.infer({"b": 2}, timeout=10) == {"b": 2}
        producer.close()
        client.close()


def test_replica_count_follows_the_master(replicated: tuple[RedisNode, RedisNode]) -> None:
    master, replica = replicated
    auto, fixed, off = ReplicaCount(-1), ReplicaCount(2), ReplicaCount(0)
    with master.client() as m, replica.client() as rep:
        assert (auto.count(m), fixed.count(m), off.count(m)) == (1, 2, 0)
        assert ReplicaCount(-1).count(rep) == 0  # a replica has no replicas to wait for
