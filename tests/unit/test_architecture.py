"""The layout's rules, checked on the source: the policy package is pure, the worker's layers
point one way, no modules import each other in a circle, and modules and functions (of
worker/, producer/ and bench/) stay small enough to read (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from tests.rigs.paths import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "worker"
PRODUCER = ROOT / "producer"
BENCH = ROOT / "bench"
POLICY = PACKAGE / "policy"
# Modules that do I/O, keep time or run threads: none of them may be imported by policy.
IMPURE = {"redis", "torch", "threading", "time", "socket", "subprocess", "asyncio", "os",
          "queue", "selectors", "select", "signal", "multiprocessing", "concurrent",
          "structlog", "logging", "prometheus_client", "psutil", "msgpack", "http", "urllib",
          "pathlib", "shutil", "io", "datetime"}
LAYERS = {"policy", "pipeline", "streams", "execution", "observe", "commands", "models"}
# The worker's layers from the bottom up: a module imports only from its own layer or those
# below it. The top-level modules are layers of their own (app.py is the composition root).
LAYER_ORDER = ["setting_sources", "setting_groups", "model_registry", "startup_error", "policy",
               "settings", "observe", "models", "execution", "streams", "pipeline",
               "model_loading", "app", "commands", "supervisor", "cli_flags", "cli", "__main__"]
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 40
# One concept that needs more room, by name and why (rather than a split made for length).
LONGER_MODULES = {
    "worker/app.py": "the composition root: every part of a worker is built in this one "
                     "place, so that no other module constructs another's parts",
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
    """The worker, the producer package (its gateway included) and the benchmarks follow the
    same limits."""
    return sorted([*PACKAGE.rglob("*.py"), *PRODUCER.rglob("*.py"), *BENCH.rglob("*.py")])


def test_the_size_checks_cover_both_packages() -> None:
    covered = {path.relative_to(ROOT).parts[0] for path in source_files()}
    assert covered == {"worker", "producer", "bench"}
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, modules: Collection[str],
                     type_hints: bool = False) -> Iterator[str]:
    """Like runtime_imports, with `from package import module` as the module itself;
    `type_hints`: those under TYPE_CHECKING too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and is_type_checking(node) and not type_hints:
            yield from (name for child in node.orelse
                        for name in imported_modules(child, modules))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield from (f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                        else node.module for alias in node.names)
        yield from imported_modules(node, modules, type_hints)


def import_graph(folders: tuple[str, ...], type_hints: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports when it runs (lazy imports included), and
    with `type_hints` those it names under TYPE_CHECKING."""
    modules = {module_name(p): p for folder in folders for p in (ROOT / folder).rglob("*.py")}
    return {name: {m for m in imported_modules(ast.parse(path.read_text()), modules,
                                               type_hints)
                   if m in modules and m != name}
            for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    # type hints count: a circle through them is a circle in the design (a Protocol of
    # what is needed breaks it, as step_graphs.py and gateway/rerank.py do)
    graph = import_graph(("worker", "producer", "bench", "tests"), type_hints=True)
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_the_worker_layers_point_one_way() -> None:
    """No module imports from a layer above its own (policy below models below execution...)."""
    rank = {layer: n for n, layer in enumerate(LAYER_ORDER)}
    assert set(rank) >= LAYERS
    upward = sorted(f"{source} -> {target}"
                    for source, targets in import_graph(("worker",)).items()
                    for target in targets
                    if source != "worker" and target != "worker"
                    and rank[layer_of(target)] > rank[layer_of(source)])
    assert upward == []


def documented_bench_commands() -> list[str]:
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    return sorted({m for path in texts
                   for m in re.findall(r"python -m\s+(bench(?:\.[a-z_]+)*)", path.read_text())})


@pytest.mark.parametrize("module", documented_bench_commands())
def test_every_documented_bench_command_runs_a_module(module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None


def test_docs_architecture_names_every_module() -> None:
    """The listing in docs/architecture.md keeps up with the code: no module left out."""
    listing = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for p in [*PACKAGE.rglob("*.py"), *PRODUCER.glob("*.py")]
               if p.name != "__init__.py"]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if p.name not in listing)
    assert missing == []
