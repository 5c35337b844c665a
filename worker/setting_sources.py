"""Where each setting came from (a flag, the environment, the config file or the default), so
that every message naming a setting says where to change it.

Settings are layered (worker/settings.py: flags over REDBATCH_* variables over the TOML
file over the defaults); this records, per setting, the highest layer that set it. A parent
process (the supervisor, the demo) hands its children their settings as flags or variables;
it hands them its own record too (INHERITED), so a child's message names what the user set.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_settings import (
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "REDBATCH_"
INHERITED = "REDBATCH_SETTING_SOURCES"  # not a setting: pydantic-settings ignores it
# A setting named in a message: as a flag (--max-batch-size) or as a snake_case name
# (max_batch_size); a one-word name (dtype, model) is named by the raiser (`also`).
NAMED = re.compile(r"--[a-z][a-z0-9-]*|\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


@dataclass(frozen=True)
class SettingSources:
    """The layer each setting came from; `names` are all the settings."""

    names: Collection[str]
    flags: Collection[str] = ()
    environment: Collection[str] = ()
    file: Path | None = None
    in_file: Collection[str] = ()
    inherited: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def find(cls, names: Collection[str], flags: Iterable[str], file: Path | None = None,
             file_keys: Iterable[str] = (), environ: Mapping[str, str] | None = None,
             ) -> SettingSources:
        environ = os.environ if environ is None else environ
        # pydantic-settings matches variable names without regard to case
        present = {key.upper() for key in environ}
        inherited = json.loads(environ.get(INHERITED, "{}") or "{}")
        return cls(names, frozenset(flags),
                   frozenset(n for n in names if f"{ENV_PREFIX}{n.upper()}" in present),
                   file, frozenset(file_keys), inherited if isinstance(inherited, dict) else {})

    def layer(self, name: str) -> str:
        if name in self.flags:
            return "flag"
        if name in self.environment:
            return "environment"
        return "file" if name in self.in_file else "default"

    def where(self, name: str) -> str:
        """"--max-batch-size (flag)", "REDBATCH_MAX_BATCH_SIZE (environment)",
        "max_batch_size in worker.toml (file)" or "max_batch_size (default)"."""
        if name in self.inherited:
            return str(self.inherited[name])
        layer = self.layer(name)
        return {"flag": f"{flag(name)} (flag)",
                "environment": f"{ENV_PREFIX}{name.upper()} (environment)",
                "file": f"{name} in {self.file} (file)"}.get(layer, f"{name} (default)")

    def named_in(self, message: str, also: Iterable[str] = ()) -> list[str]:
        """The settings `message` names (and `also`), each once, in order."""
        found = [m.removeprefix("--").replace("-", "_") for m in NAMED.findall(message)]
        return list(dict.fromkeys(n for n in [*found, *also] if n in self.names))

    def annotate(self, message: str, also: Iterable[str] = ()) -> str:
        """`message` with where each setting it names came from, e.g. "... [--metrics-port
        (flag)]"; unchanged when it names none."""
        named = self.named_in(message, also)
        if not named:
            return message
        return f"{message} [{'; '.join(self.where(n) for n in named)}]"

    def environment_for_children(self) -> dict[str, str]:
        """INHERITED: where this process's settings came from, for a child it starts."""
        return {INHERITED: json.dumps({n: self.where(n) for n in self.names
                                       if n in self.inherited or self.layer(n) != "default"})}


# pydantic-settings merges dictionaries key by key across its sources, so a flag
# `--model-options '{}'` would not clear a TOML file's options (those of another model would
# then be refused). These sources leave out what a higher layer set: each setting comes
# whole from the highest layer that sets it.

def _not_set_above(source: PydanticBaseSettingsSource, values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in source.current_state}


class WholeEnv(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _not_set_above(self, super().__call__())


class WholeToml(TomlConfigSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _not_set_above(self, super().__call__())


SECRET_SETTINGS = ("redis_url", "redis_password")  # a URL may hold a password too


def describe_validation_error(errors: list[Any], sources: SettingSources) -> str:
    """One line per error of pydantic's ValidationError.errors(), naming each setting's
    source; a secret's value is never shown."""
    lines = []
    for error in errors:
        name = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":  # from the file (or a caller's overrides)
            where = f" in {sources.file} (file)" if sources.file and name not in sources.flags \
                else ""
            lines.append(f"unknown setting '{name}'{where} "
                         "(python -m worker run --help lists them)")
        elif not error["loc"]:  # a rule across settings: its input is all of them, secrets too
            lines.append(sources.annotate(f"invalid settings: {message}"))
        elif name in SECRET_SETTINGS:
            lines.append(f"invalid setting '{name}' from {sources.where(name)}: {message}")
        else:
            lines.append(f"invalid setting '{name}' from {sources.where(name)}: {message}; "
                         f"got {error.get('input')!r}")
    return "\n".join(lines)
