"""The layout's rules, checked on the source: the policy package is pure, and modules and
functions (of worker/ and producer/) stay small enough to read (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worker"
PRODUCER = ROOT / "producer"
POLICY = PACKAGE / "policy"
# Modules that do I/O, keep time or run threads: none of them may be imported by policy.
IMPURE = {"redis", "torch", "threading", "time", "socket", "subprocess", "asyncio", "os",
          "queue", "selectors", "select", "signal", "multiprocessing", "concurrent",
          "structlog", "logging", "prometheus_client", "psutil", "msgpack", "http", "urllib",
          "pathlib", "shutil", "io", "datetime"}
LAYERS = {"policy", "pipeline", "streams", "execution", "observe", "commands", "models"}
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 40
# One concept that needs more room, by name and why (rather than a split made for length).
LONGER_MODULES = {
    "producer/protocol.py": "the wire format, defined once (docs/protocol.md): its keys, "
                            "codecs, envelopes and the entry parser that checks them",
}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> Iterator[str]:
    """Every module imported when the module runs (not those under `if TYPE_CHECKING:`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and is_type_checking(node):
            yield from (name for child in node.orelse for name in runtime_imports(child))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
        yield from runtime_imports(node)


def policy_modules() -> list[Path]:
    return sorted(POLICY.glob("*.py"))


@pytest.mark.parametrize("path", policy_modules(), ids=lambda p: p.name)
def test_policy_imports_nothing_that_does_io_or_keeps_time(path: Path) -> None:
    imported = set(runtime_imports(ast.parse(path.read_text())))
    impure = {name for name in imported if name.split(".")[0] in IMPURE}
    assert not impure, f"{path.name} imports {sorted(impure)}"
    outside = {name for name in imported
               if name.split(".")[0] in ("worker", "producer")
               and not name.startswith("worker.policy")}
    assert not outside, f"{path.name} imports {sorted(outside)} at run time: policy only " \
                        "imports policy (other types go under TYPE_CHECKING)"


def test_importing_policy_loads_no_io_library() -> None:
    """The transitive check: a fresh interpreter imports every policy module."""
    modules = ", ".join(f"worker.policy.{p.stem}" for p in policy_modules()
                        if p.stem != "__init__")
    code = (f"import sys, {modules}\n"
            "print(' '.join(sorted(m for m in ('torch', 'redis', 'socket', 'structlog', "
            "'msgpack', 'prometheus_client') if m in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    assert loaded == []


def test_the_scanner_sees_a_forbidden_import() -> None:
    """The check above can fail: it flags a plain import and ignores TYPE_CHECKING."""
    source = ("from typing import TYPE_CHECKING\nimport time\n"
              "if TYPE_CHECKING:\n    import redis\n")
    assert set(runtime_imports(ast.parse(source))) == {"typing", "time"}


def test_each_layer_is_a_sub_package() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == LAYERS


def source_files() -> list[Path]:
    """The worker and the producer package (its gateway included) follow the same limits."""
    return sorted([*PACKAGE.rglob("*.py"), *PRODUCER.rglob("*.py")])


def test_the_size_checks_cover_both_packages() -> None:
    covered = {path.relative_to(ROOT).parts[0] for path in source_files()}
    assert covered == {"worker", "producer"}
    assert PRODUCER / "client.py" in source_files()


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    lines = path.read_text().splitlines()
    if str(path.relative_to(ROOT)) not in LONGER_MODULES:
        assert len(lines) <= MAX_MODULE_LINES, f"{len(lines)} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
