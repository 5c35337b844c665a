"""`python -m worker`'s own arguments: a bad one is one argparse line, not a traceback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rigs.paths import REPO_ROOT
from worker.cli import COMMAND_SETTINGS, COMMANDS, build_parser
from worker.model_registry import BUILTIN
from worker.setting_groups import GROUP_NAMES
from worker.settings import Settings


@pytest.mark.parametrize("argv, message", [
    (["stats", "--interval", "-1"], "argument --interval: must be 0 or more, got -1"),
    (["stats", "--watch", "0"], "argument --watch: must be above 0, got 0"),
    (["dead-letters", "--requeue", "notanid"], "'notanid' is not a stream entry id"),
    (["dead-letters", "--limit", "x"], "'x' is not a number"),
    (["calibrate", "--repeats", "0"], "argument --repeats: must be above 0"),
    (["demo", "--count", "-5"], "argument --count: must be above 0"),
])
def test_a_bad_command_argument_is_refused_with_one_line(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert message in error[-1] and len(error) == 2  # the short usage line, then the error


def test_good_command_arguments_parse() -> None:
    args = build_parser().parse_args(["dead-letters", "--requeue", "1733140000000-0",
                                      "--limit", "5"])
    assert args.requeue == ["1733140000000-0"] and args.limit == 5
    assert build_parser().parse_args(["stats", "--watch"]).watch == 2.0
    assert build_parser().parse_args(["stats", "--interval", "0"]).interval == 0.0


# --- `--help` a newcomer can read, and messages that say where a setting came from (issue 33)

ROOT = REPO_ROOT
OWN_FLAGS = {"run": [], "demo": ["--sentences", "--count", "--max-new-tokens"],
             "dead-letters": ["--limit", "--requeue", "--requeue-all"],
             "calibrate": ["--repeats"], "stats": ["--models", "--watch", "--json", "--interval"]}


def worker_cli(*argv: str, env: dict[str, str] | None = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REDBATCH_")}
    return subprocess.run([sys.executable, "-m", "worker", *argv], cwd=cwd, text=True,
                          env={**clean, "PYTHONPATH": str(ROOT), "COLUMNS": "100", **(env or {})},
                          capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Each command's --help, from the real CLI."""
    texts = {}
    for command in COMMANDS:
        done = worker_cli(command, "--help")
        assert done.returncode == 0, done.stderr
        texts[command] = done.stdout
    return texts


def flag_lines(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines()
            if line.startswith("  --") or line.startswith("  -h")]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_shows_its_own_flags_first_then_the_settings_by_group(
        helps: dict[str, str], command: str) -> None:
    text = helps[command]
    settings_at = text.index("worker settings: ")
    for own in OWN_FLAGS[command]:
        assert -1 < text.index(f"  {own} ") < settings_at, f"{own} before the settings"
    groups = re.findall(r"^worker settings: (\w+):$", text, re.MULTILINE)
    order = [g for g in GROUP_NAMES if g in groups]
    assert groups == order and len(groups) == len(set(groups)), "each group once, in order"
    if COMMAND_SETTINGS[command] is None:
        assert set(groups) == set(GROUP_NAMES)
        assert len(flag_lines(text)) == len(Settings.model_fields) + len(OWN_FLAGS[command]) + 2


def test_a_command_lists_only_the_settings_it_reads(helps: dict[str, str]) -> None:
    assert "--max-batch-size" not in helps["stats"] and "--model " not in helps["stats"]
    assert "--redis-url" not in helps["calibrate"]
    assert "--max-batch-size" in helps["calibrate"] and "--model " in helps["dead-letters"]
    # the others are accepted as a file or variable would be (a script's common flags)
    args = build_parser().parse_args(["stats", "--max-batch-size", "4", "--json"])
    assert args.max_batch_size == "4" and args.json


@pytest.mark.parametrize("command", ["run", "calibrate"])
def test_every_flag_shows_its_default(helps: dict[str, str], command: str) -> None:
    text = helps[command]
    entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    missing = [e.split()[0] for e in entries if e.strip()
               if "(default: " not in " ".join(e.split())
               and not e.startswith(("-h", "--config"))]
    assert not missing, f"no default shown for {missing}"
    flat = " ".join(text.split())
    assert ("--max-batch-size VALUE most requests in one batch; on CUDA 512 unless set "
            "(default: 32)") in flat
    assert "(default: <hostname>-<pid>)" in " ".join(helps["run"].split())


def test_model_lists_the_built_in_models(helps: dict[str, str]) -> None:
    entry = re.search(r"  --model VALUE(.*?)\n  --", helps["run"], re.DOTALL)
    assert entry is not None
    listed = " ".join(entry.group(1).split())
    assert all(name in listed for name in BUILTIN), listed


def test_help_does_not_import_torch() -> None:
    """--help (and stats) stay quick: the models' registry is torch-free."""
    done = subprocess.run([sys.executable, "-c", "import sys; from worker.cli import "
                           "build_parser; build_parser(); print('torch' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_stats_help_and_behaviour_agree_on_the_embedded_redis(helps: dict[str, str],
                                                              tmp_path: Path) -> None:
    """stats reads a running worker's embedded Redis and starts none: --help says so."""
    text = " ".join(helps["stats"].split())
    assert "stats never starts one" in text and "starts an embedded" not in text
    done = worker_cli("stats", "--data-dir", str(tmp_path / "none"), cwd=tmp_path)
    assert done.returncode == 2 and "stats needs --redis-url" in done.stderr


def test_the_top_level_help_lists_the_commands() -> None:
    done = worker_cli("--help")
    assert done.returncode == 0
    assert all(command in done.stdout for command in COMMANDS)


@pytest.mark.parametrize("layer", ["flag", "environment", "file"])
def test_a_taken_metrics_port_names_where_the_port_was_set(layer: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        config = tmp_path / "worker.toml"
        config.write_text(f"metrics_port = {port}\n" if layer == "file" else "")
        args = ["--config", str(config), "--model", "echo", "--log-level", "error"]
        done = worker_cli(*args, *(["--metrics-port", port] if layer == "flag" else []),
                          env={"REDBATCH_METRICS_PORT": port} if layer == "environment" else {})
    where = {"flag": "[--metrics-port (flag)]",
             "environment": "[REDBATCH_METRICS_PORT (environment)]",
             "file": f"[metrics_port in {config} (file)]"}[layer]
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"redbatch: cannot serve metrics on port {port}: ")
    assert "give each its own --metrics-port" in line and line.endswith(where)
