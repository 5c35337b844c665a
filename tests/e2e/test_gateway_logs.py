"""Issue 33: the gateway says which Redis it uses, logs an outage and the recovery once
each, one access line per request at debug; the embedded Redis's URL file."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from producer import local_redis
from producer.gateway import events
from producer.gateway.app import create_app
from producer.gateway.settings import load_gateway_settings
from tests.e2e.test_gateway import running_gateway
from tests.rigs.servers import BINARIES, RedisNode, wait_until


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def events_named(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_the_start_line_names_redis_with_the_password_masked() -> None:
    settings = load_gateway_settings(redis_url="redis://:s3cret@127.0.0.1:1/0",
                                     api_keys="k1", port=8123)
    with capture_logs() as logs:
        create_app(settings)
    [start] = events_named(logs, "gateway.starting")
    assert start["redis"] == "redis://:***@127.0.0.1:1/0" and "s3cret" not in str(start)
    assert (start["redis_auth"], start["api_keys"], start["bind"]) == (True, True,
                                                                       "127.0.0.1:8123")
    assert start["redis_from"] == "setting"


def test_an_outage_and_the_recovery_are_logged_once_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "RECOVERY_PING_S", 0.05)
    node = RedisNode(BINARIES[0], tmp_path / "redis", ["save ''"])
    with capture_logs() as logs, running_gateway(f"redis://127.0.0.1:{node.port}/0") as base:
        assert [get(f"{base}/readyz") for _ in range(3)] == [503, 503, 503]
        assert len(events_named(logs, "redis.unavailable")) == 1
        node.start()
        try:
            wait_until(lambda: bool(events_named(logs, "redis.recovered")), 10, "no recovery")
            assert get(f"{base}/readyz") == 200
        finally:
            node.stop()
    assert len(events_named(logs, "redis.recovered")) == 1
    assert len(events_named(logs, "redis.unavailable")) == 1


def test_one_access_line_per_request_at_debug(redis_url: str) -> None:
    with capture_logs() as logs, running_gateway(redis_url, log_level="debug") as base:
        assert get(f"{base}/healthz") == 200
        assert get(f"{base}/nothing") == 404
        time.sleep(0.05)
    lines = [(e["method"], e["path"], e["status"]) for e in events_named(logs, "http.request")]
    assert lines == [("GET", "/healthz", 200), ("GET", "/nothing", 404)]


def test_the_embedded_redis_url_file_is_found_without_a_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDBATCH_REDIS_URL", raising=False)
    assert load_gateway_settings().redis_url == local_redis.FALLBACK_URL
    with local_redis.published("redis://127.0.0.1:4242/0") as path:
        assert path == Path(".redbatch/redis.url")
        settings = load_gateway_settings()
        assert settings.redis_url == "redis://127.0.0.1:4242/0"
        assert events.redis_source(settings) == str(path)
    assert not path.exists()


def test_the_worker_publishes_its_embedded_redis(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.commands.stats import run_stats
    from worker.settings import load_settings
    from worker.streams.target import redis_url

    monkeypatch.delenv("REDBATCH_REDIS_URL", raising=False)
    settings = load_settings(None, data_dir=tmp_path / "data")
    with redis_url(settings) as url:
        assert local_redis.local_url(tmp_path / "data") == url
        assert run_stats(settings, None, None, True, 0) == 0  # found without a URL
        with redis_url(settings) as again:  # a second worker here joins it
            assert again == url
        assert local_redis.local_url(tmp_path / "data") == url
    assert local_redis.local_url(tmp_path / "data") is None
    (tmp_path / "data" / "redis.url").write_text(url)  # left by a killed worker
    assert local_redis.reachable_url(tmp_path / "data") is None


pytestmark = pytest.mark.usefixtures("fresh_logs")
