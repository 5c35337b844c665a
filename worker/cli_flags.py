"""The worker's settings as command-line flags, grouped for `--help` (setting_groups.py),
each with its default; and the argparse types the commands' own flags use."""

from __future__ import annotations

import argparse
import json
import re
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from pydantic.fields import FieldInfo

from worker.model_registry import BUILTIN
from worker.setting_groups import GROUPS
from worker.settings import Settings, SettingsError

ENTRY_ID = re.compile(r"\d+-\d+")
# A default that is not a constant, said in words rather than as this process's value.
DEFAULT_TEXT = {"consumer": "<hostname>-<pid>"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A command's own flags with their defaults (settings say theirs in their help text)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default in (
                None, False, argparse.SUPPRESS) or action.default == []):
            return text
        return f"{text} (default: {action.default})".strip()


def is_structured(annotation: Any) -> bool:
    """list/dict settings take JSON on the command line, as in the environment."""
    types = (annotation, *typing.get_args(annotation))  # dict[...] itself, or inside X | None
    return any(typing.get_origin(t) in (list, dict) for t in types)


def default_text(name: str, field: FieldInfo) -> str:
    if name in DEFAULT_TEXT:
        return DEFAULT_TEXT[name]
    value = field.get_default(call_default_factory=True)
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def setting_help(name: str, field: FieldInfo, override: str | None = None) -> str:
    text = override or field.description or ""
    if name == "model":  # the registry's names, so a new built-in shows up here by itself
        text = f"{text}; built-ins: {', '.join(BUILTIN)}"
    return f"{text} (default: {default_text(name, field)})".lstrip()


def metavar(field: FieldInfo) -> str:
    if is_structured(field.annotation):
        return "JSON"
    return "BOOL" if field.annotation in (bool, "bool") else "VALUE"


def add_setting_flags(parser: argparse.ArgumentParser, names: Collection[str] | None = None,
                      helps: Mapping[str, str] | None = None) -> None:
    """The settings `names` (all: None) as flags, one argument group per setting group,
    after the command's own flags; `helps` replaces a setting's help for this command."""
    fields = Settings.model_fields
    for group, about, members in GROUPS:
        chosen = [n for n in members if names is None or n in names]
        section = parser.add_argument_group(f"worker settings: {group}", about) if chosen \
            else parser
        for name in members:  # the others are accepted, unlisted: as in a file or variable
            section.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                                 metavar=metavar(fields[name]), help=argparse.SUPPRESS
                                 if name not in chosen else
                                 setting_help(name, fields[name], (helps or {}).get(name)))


def setting_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (None: not given), JSON ones decoded."""
    overrides: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(args, name, None)
        if value is not None and is_structured(field.annotation):
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
