"""The benchmark corpus: paragraphs of the Python standard library's docstrings.

Real English written by many hands, with a natural long-tailed length mix (one-line
summaries to long explanations). Built at run time from the interpreter's own stdlib
sources, deterministically: sorted files, a fixed seed.
"""

from __future__ import annotations

import ast
import os
import random
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
                "__pycache__", "turtledemo", "ensurepip", "tkinter", "pydoc_data"}
MIN_CHARS = 20
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Corpus:
    texts: list[str]
    source: str  # where the texts came from, for the report
    files: int
    paragraphs: int  # distinct paragraphs found, before sampling


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """The stdlib's .py files in a stable order, without tests and GUI demos."""
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        found += [Path(directory, n) for n in sorted(names) if n.endswith(".py")]
    return found


def docstrings(source: bytes) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file for another Python version
        return
    for node in ast.walk(tree):
        if isinstance(node, DOCUMENTED) and (text := ast.get_docstring(node)):
            yield text


def paragraphs(docstring: str) -> Iterator[str]:
    """Blank-line separated prose paragraphs on one line; code and doctests are skipped."""
    for block in docstring.split("\n\n"):
        text = " ".join(block.split())
        letters = sum(c.isalpha() for c in text)
        if len(text) >= MIN_CHARS and ">>>" not in text and letters >= 0.6 * len(text):
            yield text


def build_corpus(size: int, seed: int = 0, max_files: int | None = None) -> Corpus:
    """`size` distinct paragraphs sampled with `seed` (fewer if the stdlib has fewer)."""
    root = stdlib_root()
    files = stdlib_sources(root)[:max_files]
    found: dict[str, None] = {}  # an ordered set
    for path in files:
        for docstring in docstrings(path.read_bytes()):
            found.update(dict.fromkeys(paragraphs(docstring)))
    pool = list(found)
    texts = random.Random(seed).sample(pool, min(size, len(pool)))
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(texts, f"docstring paragraphs of the Python {version} standard library "
                  f"({root}), seed {seed}", len(files), len(pool))
