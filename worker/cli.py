"""`python -m worker [run|demo] [--flag value ...]`: every setting is also a flag."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.cli_flags import (
    HelpFormatter,
    add_setting_flags,
    entry_id,
    positive,
    setting_overrides,
)
from worker.observe.log import configure_logging
from worker.settings import Settings, SettingsError, load_settings

COMMANDS = ("run", "demo", "dead-letters", "calibrate", "stats")
USAGE = "%(prog)s [--flag value ...] (--help lists them: its own, then the settings)"
CONNECTION = ("redis_url", "redis_password", "redis_cluster", "namespace", "data_dir")
LOGS = ("log_level", "log_format")
# The settings each command reads (None: all); the others are left off its --help.
COMMAND_SETTINGS: dict[str, frozenset[str] | None] = {
    "run": None, "demo": None,
    "dead-letters": frozenset((*CONNECTION, "model", "model_name", "block_ms", *LOGS)),
    "calibrate": frozenset((
        "model", "model_name", "model_options", "device", "dtype", "torch_threads",
        "instances", "cpu_cores", "cache_dir", "max_batch_size", "max_batch_tokens",
        "bucket_boundaries", "calibration_dir", "memory_limit_bytes",
        "memory_high_watermark", *LOGS)),
    "stats": frozenset((*CONNECTION, "group", *LOGS)),
}
OTHER_SETTINGS = ("The other worker settings (`python -m worker run --help`) are accepted "
                  "too,\nas in the environment and a --config file, and not read.")
STATS_HELPS = {"redis_url": (
    "the Redis to read: redis://, rediss:// (TLS), redis+sentinel://host:port[,...]/service"
    "[/db] or rediss+sentinel://; none: the embedded Redis of a worker running in this "
    "directory (<data_dir>/redis.url). stats never starts one")}


def add_command(commands: Any, name: str, help: str,
                own: Callable[[argparse.ArgumentParser], None] | None = None,
                helps: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """A subcommand: its own flags first (`own`), then the settings it reads, by group."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, usage=USAGE, help=help, description=help, formatter_class=HelpFormatter,
        epilog=None if COMMAND_SETTINGS[name] is None else OTHER_SETTINGS)
    parser.add_argument("--config", type=Path, help="TOML settings file (flags override it, "
                        "and REDBATCH_* variables; it overrides the defaults)")
    if own is not None:
        own(parser)
    add_setting_flags(parser, COMMAND_SETTINGS[name], helps)
    return parser


def demo_flags(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--sentences", type=Path, default=None, help="one text per line (a "
                      "generative --model: one question per line, instead of its own)")
    demo.add_argument("--count", type=positive(int), default=300,
                      help="how many texts to embed (or questions to answer)")
    demo.add_argument("--max-new-tokens", type=positive(int), default=48,
                      help="a generative --model (smollm2): the length of each answer")


def dead_letter_flags(dead: argparse.ArgumentParser) -> None:
    dead.add_argument("--limit", type=positive(int), default=100,
                      help="how many to list (oldest first)")
    dead.add_argument("--requeue", nargs="+", metavar="DEAD_LETTER_ID", default=[],
                      type=entry_id, help="put these back on the request stream")
    dead.add_argument("--requeue-all", action="store_true", help="requeue every one listed")


def calibrate_flags(calibrate: argparse.ArgumentParser) -> None:
    calibrate.add_argument("--repeats", type=positive(int), default=3,
                           help="timed runs per batch size")


def stats_flags(stats: argparse.ArgumentParser) -> None:
    stats.add_argument("--models", nargs="+", default=None, help="only these (default: all)")
    stats.add_argument("--watch", type=positive(float), nargs="?", const=2.0, default=None,
                       metavar="SECONDS", help="refresh every SECONDS (default: once; "
                       "SECONDS: 2)")
    stats.add_argument("--json", action="store_true", help="JSON (one line per reading)")
    stats.add_argument("--interval", type=positive(float, zero=True), default=1.0,
                       help="seconds between the two readings that give the throughput")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker", formatter_class=HelpFormatter,
        description="redbatch worker: batch inference from Redis",
        epilog="`python -m worker COMMAND --help` lists that command's flags, then the worker "
               "settings it reads, by group.\nWith no command, `run`: `python -m worker "
               "--model echo` = `python -m worker run --model echo`.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_command(commands, "run", "serve requests (the default)")
    add_command(commands, "demo", "embedded Redis + a worker + sample sentences", demo_flags)
    add_command(commands, "dead-letters", "list dead letters, or requeue them",
                dead_letter_flags)
    add_command(commands, "calibrate", "time each bucket at growing batch sizes and write "
                "the best sizes for `run` to load", calibrate_flags)
    add_command(commands, "stats", "queue, consumers and throughput per model", stats_flags,
                STATS_HELPS)
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
        return refuse(exc, settings)


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


def refuse(exc: Exception, settings: Settings | None = None) -> int:
    """One line for the user, no traceback, exit status 2; each setting it names followed
    by where it came from (a SettingsError's message says so itself)."""
    message = str(exc)
    if settings is not None and not isinstance(exc, SettingsError):
        message = settings.sources.annotate(message, getattr(exc, "settings", ()))
    print(f"redbatch: {message}", file=sys.stderr)
    return 2
