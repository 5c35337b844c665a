"""What every measured system is to the benchmark: a name, a dtype, configurations to try.

A system encodes texts with one configuration (a batch size, a layout); the benchmark picks
its fastest configuration on part of the corpus, then times that one in every round. A peer
whose package is missing is a `Skipped`, reported with why.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy

#: a configuration's encode: every text through the system once; a float it returns is its
#: own texts/s (a served system times from first submit to last reply), else it is timed here
Encode = Callable[[Sequence[str]], Any]


@dataclass
class System:
    name: str  # e.g. "onnxruntime int8"
    peer: str  # the project it belongs to: redbatch, onnxruntime, sentence-transformers
    dtype: str
    configs: dict[str, Encode]  # by description, e.g. "batch 64"
    note: str = ""
    chosen: str = ""  # the fastest configuration on the selection texts
    selection: dict[str, float] = field(default_factory=dict)  # texts/s by configuration
    rates: list[float] = field(default_factory=list)  # texts/s, one per round
    min_cosine: float | None = None  # against the float32 reference (None: not compared)
    # its normalised embeddings, where its encode returns a rate instead (redbatch's)
    embed: Callable[[Sequence[str]], numpy.ndarray] | None = None

    def choose(self, texts: Sequence[str]) -> str:
        """Time every configuration once on `texts` (after a warm pass) and keep the fastest;
        a system of one configuration is only warmed up on them."""
        for description, encode in self.configs.items():
            encode(texts[:32])  # first calls pay for allocations and kernel selection
            if len(self.configs) == 1:
                encode(texts)
            else:
                self.selection[description] = rate(encode, texts)
        self.chosen = max(self.selection, key=lambda d: self.selection[d]) \
            if self.selection else next(iter(self.configs))
        return self.chosen

    def measure(self, texts: Sequence[str]) -> float:
        self.rates.append(rate(self.configs[self.chosen], texts))
        return self.rates[-1]


def embeddings(system: System, texts: Sequence[str]) -> numpy.ndarray | None:
    """Its chosen configuration's rows for `texts` (None: it does not return them)."""
    rows = system.embed(texts) if system.embed else system.configs[system.chosen](texts)
    return numpy.asarray(rows, dtype=numpy.float32) if isinstance(rows, numpy.ndarray) else None


def compare(systems: Sequence[System], reference: System, texts: Sequence[str]) -> None:
    """Each system's lowest cosine to `reference` (normalised rows) over `texts`."""
    expected = embeddings(reference, texts)
    if expected is None:
        return
    for system in systems:
        rows = embeddings(system, texts)
        if rows is not None:
            system.min_cosine = float((rows * expected).sum(axis=1).min())


@dataclass(frozen=True)
class Skipped:
    name: str
    peer: str
    reason: str


def rate(encode: Encode, texts: Sequence[str]) -> float:
    started = time.perf_counter()
    result = encode(texts)
    return result if isinstance(result, float) else len(texts) / (time.perf_counter() - started)


def missing(*modules: str) -> str | None:
    """Why a peer cannot run here ("not installed: ..."), None when its modules import."""
    absent = [name for name in modules if importlib.util.find_spec(name) is None]
    return f"not installed: no module {', '.join(absent)} (pip install '.[bench]')" \
        if absent else None


def length_order(texts: Sequence[str]) -> list[int]:
    """Indices longest text first, as a fair offline runner batches (sentence-transformers'
    encode sorts by length too): each batch pads to texts of about one length."""
    return sorted(range(len(texts)), key=lambda i: -len(texts[i]))
