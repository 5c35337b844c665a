"""`python -m producer serve [--flag value ...]`: the gateway on uvicorn.

Every setting is a flag and a REDBATCH_* variable. With `--processes N`, uvicorn starts N
processes on the one port; the flags reach them through the environment, since each builds
its own app (create_app reads the settings there). HTTP is parsed by httptools and the loop
is uvloop's (uvicorn picks uvloop when it is installed, as it is with redbatch), with the
head and body of a response in one write and the header size cap and read deadlines enforced
(transport.py); without httptools, uvicorn's h11, which caps the header size only.

Safe by default: the gateway listens on 127.0.0.1. A non-loopback address with no `api_keys`
is refused at start unless `allow_unauthenticated` is set, and then logged as a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import ipaddress
import os
import sys
from typing import Any

import structlog
import uvicorn
from pydantic import SecretStr

from producer.gateway.events import configure_logging
from producer.gateway.settings import GatewaySettings, GatewaySettingsError, load_gateway_settings

HTTPTOOLS = importlib.util.find_spec("httptools") is not None
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}
log = structlog.get_logger("redbatch.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer serve",
                                     description="OpenAI-compatible HTTP gateway")
    for name, field in GatewaySettings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "" if default is None or "default" in (field.description or "") else \
            f" (default: {default})"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                            metavar="VALUE", help=f"{field.description or ''}{shown}".strip())
    return parser


def as_environment(settings: GatewaySettings) -> dict[str, str]:
    """The settings as REDBATCH_* variables, for uvicorn's child processes."""
    env = {}
    for name, value in settings.model_dump().items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is not None:
            env[f"REDBATCH_{name.upper()}"] = (",".join(value) if isinstance(value, list)
                                              else str(value))
    return env


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's options for these settings, for uvicorn.run and uvicorn.Config alike. The
    protocol goes as a class: older uvicorn (0.29) takes only its own protocols by name."""
    return {"host": settings.host, "port": settings.port, "log_level": settings.log_level,
            "access_log": False, "http": http_protocol(),
            "h11_max_incomplete_event_size": settings.max_header_bytes}


def http_protocol() -> type[asyncio.Protocol] | str:
    """The guarded httptools protocol (transport.py), or uvicorn's h11 without httptools."""
    if not HTTPTOOLS:
        return "h11"
    from producer.gateway.transport import GuardedHttpToolsProtocol

    return GuardedHttpToolsProtocol


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in LOOPBACK_NAMES


def bind_refusal(settings: GatewaySettings) -> str | None:
    """Why the gateway must not start on this address, or None. An open bind with no keys
    is allowed only when asked for (allow_unauthenticated), and then logged."""
    if is_loopback(settings.host) or settings.api_keys:
        return None
    if settings.allow_unauthenticated:
        log.warning("gateway.unauthenticated", host=settings.host,
                    note="no api_keys: anyone who reaches this address can call the API")
        return None
    return (f"refusing to listen on {settings.host} with no api_keys: set api_keys, or "
            "allow_unauthenticated=true to serve it open, or host=127.0.0.1")


def app_from_environment() -> Any:
    """A `--processes` child's app: its settings from the environment, its own logging."""
    from producer.gateway.app import create_app

    settings = load_gateway_settings()
    configure_logging(settings.log_level)
    return create_app(settings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = load_gateway_settings(**vars(args))
    except GatewaySettingsError as exc:
        print(f"producer serve: {exc}", file=sys.stderr)
        return 2
    refusal = bind_refusal(settings)
    if refusal is not None:
        print(f"producer serve: {refusal}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if settings.processes > 1:
        os.environ.update(as_environment(settings))
        uvicorn.run("producer.gateway.serve:app_from_environment", factory=True,
                    workers=settings.processes, **server_options(settings))
        return 0
    from producer.gateway.app import create_app

    uvicorn.run(create_app(settings), **server_options(settings))
    return 0
