"""`python -m worker [run|demo] [--flag value ...]`: every setting is also a flag."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from worker.log import configure_logging
from worker.settings import Settings, SettingsError, load_settings

COMMANDS = ("run", "demo")


def _is_structured(annotation: Any) -> bool:
    """list/dict settings take JSON on the command line, as in the environment."""
    types = (annotation, *typing.get_args(annotation))  # dict[...] itself, or inside X | None
    return any(typing.get_origin(t) in (list, dict) for t in types)


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML settings file")
    for name, field in Settings.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                            metavar="JSON" if _is_structured(field.annotation) else "VALUE",
                            help=field.description)


def setting_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(args, name, None)
        if value is not None and _is_structured(field.annotation):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SettingsError(f"invalid setting '{name}': --{name.replace('_', '-')} "
                                    f"takes JSON ({exc.msg}); got {value!r}") from None
        overrides[name] = value
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker",
                                     description="redbatch worker: batch inference from Redis")
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("run", help="serve requests (the default)")
    add_setting_flags(run)
    demo = commands.add_parser("demo", help="embedded Redis + a worker + sample sentences")
    add_setting_flags(demo)
    demo.add_argument("--sentences", type=Path, default=None, help="one text per line")
    demo.add_argument("--count", type=int, default=300, help="how many texts to embed")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "run")
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args.config, **setting_overrides(args))
    except SettingsError as exc:
        return refuse(exc)
    configure_logging(settings.log_level, settings.log_format)
    from worker.app import StartupError, serve  # imports torch (seconds): valid settings only

    try:
        if args.command == "demo":
            from worker.demo import run_demo

            return run_demo(settings, args.sentences, args.count)
        return serve(settings)
    except (SettingsError, StartupError) as exc:
        return refuse(exc)


def refuse(exc: Exception) -> int:
    """One line for the user, no traceback, exit status 2."""
    print(f"redbatch: {exc}", file=sys.stderr)
    return 2
