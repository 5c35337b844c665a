"""`python -m worker [run|demo] [--flag value ...]`: every setting is also a flag."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.observe.log import configure_logging
from worker.settings import Settings, SettingsError, load_settings

COMMANDS = ("run", "demo", "dead-letters", "calibrate", "stats")
USAGE = "%(prog)s [--flag value ...] (--help lists them)"  # not all 50 settings' flags
ENTRY_ID = re.compile(r"\d+-\d+")


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


def positive(kind: type[int] | type[float], zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a number above 0 (or at least 0, with `zero`), or one line saying
    what is wrong."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > 0 or (zero and value == 0)) or value == float("inf"):  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"must be {'0 or more' if zero else 'above 0'}, got {text}")
        return value
    return parse


def entry_id(text: str) -> str:
    """An argparse type: a stream entry id, <ms>-<seq>."""
    if not ENTRY_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stream entry id (<ms>-<seq>, e.g. 1733140000000-0)")
    return text


def add_command(commands: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand that takes every setting as a flag."""
    parser: argparse.ArgumentParser = commands.add_parser(name, usage=USAGE, help=help)
    add_setting_flags(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker",
                                     description="redbatch worker: batch inference from Redis")
    commands = parser.add_subparsers(dest="command")
    add_command(commands, "run", "serve requests (the default)")
    demo = add_command(commands, "demo", "embedded Redis + a worker + sample sentences")
    demo.add_argument("--sentences", type=Path, default=None, help="one text per line (a "
                      "generative --model: one question per line, instead of its own)")
    demo.add_argument("--count", type=positive(int), default=300,
                      help="how many texts to embed (or questions to answer)")
    demo.add_argument("--max-new-tokens", type=positive(int), default=48,
                      help="a generative --model (smollm2): the length of each answer")
    dead = add_command(commands, "dead-letters", "list dead letters, or requeue them")
    dead.add_argument("--limit", type=positive(int), default=100,
                      help="how many to list (oldest first)")
    dead.add_argument("--requeue", nargs="+", metavar="DEAD_LETTER_ID", default=[],
                      type=entry_id,
                      help="put these back on the request stream")
    dead.add_argument("--requeue-all", action="store_true", help="requeue every one listed")
    calibrate = add_command(commands, "calibrate", "time each bucket at growing batch sizes "
                                    "and write the best sizes for `run` to load")
    calibrate.add_argument("--repeats", type=positive(int), default=3,
                           help="timed runs per batch size")
    add_stats_parser(commands)
    return parser


def add_stats_parser(commands: Any) -> None:
    stats = add_command(commands, "stats", "queue, consumers and throughput per model")
    stats.add_argument("--models", nargs="+", default=None, help="only these (default: all)")
    stats.add_argument("--watch", type=positive(float), nargs="?", const=2.0, default=None,
                       metavar="SECONDS", help="refresh every SECONDS (default 2)")
    stats.add_argument("--json", action="store_true", help="JSON (one line per reading)")
    stats.add_argument("--interval", type=positive(float, zero=True), default=1.0,
                       help="seconds between the two readings that give the throughput")


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
    if args.command == "stats":  # reads Redis only: no torch to import
        from worker.commands.stats import run_stats

        try:
            return run_stats(settings, args.models, args.watch, args.json, args.interval)
        except BrokenPipeError:  # `stats --watch --json | head`: the reader has had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    from worker.app import StartupError  # torch: valid settings only

    try:
        return run_command(args, settings)
    except (SettingsError, StartupError) as exc:
        return refuse(exc)


def run_command(args: argparse.Namespace, settings: Settings) -> int:
    """Each command in its own module (commands/), imported only when it runs."""
    if args.command == "demo":
        return run_demo_command(args, settings)
    if args.command == "dead-letters":
        from worker.commands.dead_letters import run_dead_letters

        return run_dead_letters(settings, args.limit, args.requeue, args.requeue_all)
    if args.command == "calibrate":
        from worker.commands.calibrate import run_calibration

        return run_calibration(settings, args.repeats)
    if settings.processes > 1 or settings.devices:
        from worker.supervisor import supervise

        return supervise(settings)
    from worker.commands.run import serve

    return serve(settings)


def run_demo_command(args: argparse.Namespace, settings: Settings) -> int:
    """A generative model streams its answers (demo_generate.py); any other embeds texts."""
    from worker.commands.demo_generate import is_generative, run_generate_demo

    if is_generative(settings.model):
        return run_generate_demo(settings, args.sentences, args.count, args.max_new_tokens)
    from worker.commands.demo import run_demo

    return run_demo(settings, args.sentences, args.count)


def refuse(exc: Exception) -> int:
    """One line for the user, no traceback, exit status 2."""
    print(f"redbatch: {exc}", file=sys.stderr)
    return 2
