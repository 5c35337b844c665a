"""Which batch shapes get a CUDA graph, and which captured shape a real batch replays in.

A CUDA graph replays a fixed shape, so the encoder is captured once per (bucket length,
batch-size class) at warm-up (execution/cuda_graphs.py) and a batch runs in the smallest
captured shape that holds it: its rows padded up to the class, its tokens up to the bucket
length. The classes per length are the powers of two, with a step halfway between each two
from 8 up (12, 24, 48, ...: a batch of 257 rows pads to 384, not 512), up to the most rows a
batch of that length may hold (max_batch_size, and max_batch_tokens over the length), which
is a class itself. A batch no class holds runs eagerly. Pure: counts in, counts out.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

HALF_STEPS_FROM = 8  # below this a class is cheap enough that powers of two suffice


@dataclass(frozen=True, slots=True)
class ShapeClasses:
    """The captured shapes: for each bucket length (increasing), its batch-size classes."""

    classes: tuple[tuple[int, tuple[int, ...]], ...]  # (length, increasing row classes)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, length) to capture, the largest first: later, smaller captures then
        reuse the memory pool's blocks the first ones made."""
        shapes = [(rows, length) for length, rows_classes in self.classes
                  for rows in rows_classes]
        return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)

    def fit(self, rows: int, length: int) -> tuple[int, int] | None:
        """The smallest captured (rows, length) holding a batch of `rows` x `length` tokens:
        the shortest bucket length at least `length`, then its smallest class of at least
        `rows`; None (run eagerly) when that length has no class so large, or no length is."""
        if rows < 1 or length < 1:
            return None
        lengths = [captured for captured, _ in self.classes]
        at = bisect_left(lengths, length)
        if at == len(lengths):
            return None
        captured_length, rows_classes = self.classes[at]
        index = bisect_left(rows_classes, rows)
        if index == len(rows_classes):
            return None
        return rows_classes[index], captured_length


def batch_classes(cap: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 12, 16, 24, 32, 48, ... below `cap`, then `cap` itself."""
    cap = max(1, cap)
    sizes = {1 << k for k in range(cap.bit_length())}
    sizes |= {3 << (k - 1) for k in range(cap.bit_length()) if 1 << k >= HALF_STEPS_FROM}
    return (*sorted(size for size in sizes if size < cap), cap)


def rows_cap(length: int, max_batch_size: int, max_batch_tokens: int) -> int:
    """The most rows a batch of `length` tokens may have under both limits (at least one)."""
    return max(1, min(max_batch_size, max_batch_tokens // max(1, length)))


def shape_classes(boundaries: Sequence[int], max_batch_size: int,
                  max_batch_tokens: int) -> ShapeClasses:
    """The classes for each bucket boundary (the open-ended last bucket has no fixed length,
    so none)."""
    return ShapeClasses(tuple(
        (length, batch_classes(rows_cap(length, max_batch_size, max_batch_tokens)))
        for length in sorted(set(boundaries)) if length > 0))


DECODE_LENGTHS_FROM = 256  # the shortest context a decode step's graph is captured for
DECODE_LENGTHS_UP_TO = 4096  # longer contexts decode eagerly: rarer, and large to capture
PREFILL_TOKENS_FROM = 64  # a packed prefill of fewer tokens pads to 64: no cost on a GPU


def doubling(first: int, last: int) -> tuple[int, ...]:
    """first, 2 x first, 4 x first, ... below `last`, then `last` itself."""
    last = max(1, last)
    return (*[first << k for k in range(last.bit_length()) if first << k < last], last)


def decode_rows(max_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_seqs`, then `max_seqs`: a decode row costs little on a GPU
    next to a launch, so powers of two (fewer graphs to capture) pad cheaply."""
    return doubling(1, max_seqs)


def decode_classes(max_seqs: int, max_context: int) -> ShapeClasses:
    """The decode steps to capture: every row class up to `max_seqs` at each context length
    class, 256, 512, ... doubling up to the longest a sequence may reach (`max_context`, at
    most DECODE_LENGTHS_UP_TO), which is a class itself. A step pads its rows and each row's
    context to the smallest class that holds it (ShapeClasses.fit)."""
    rows = decode_rows(max_seqs)
    lengths = doubling(DECODE_LENGTHS_FROM, min(max_context, DECODE_LENGTHS_UP_TO))
    return ShapeClasses(tuple((length, rows) for length in lengths))


def prefill_classes(max_step_tokens: int, max_context: int) -> ShapeClasses:
    """The packed prefills to capture, as ShapeClasses whose rows are new tokens (queries)
    and whose lengths are the keys they read (every packed row's history): key classes 64,
    128, ... doubling up to `max_context` (at most DECODE_LENGTHS_UP_TO), each with the
    query classes 64, 128, ... up to the step's token budget (`max_step_tokens`) that it
    can hold (a new token is a key too). A step's first chunks read as many keys as they
    bring, later chunks of a long prompt more; `fit(queries, keys)` pads both."""
    queries = doubling(PREFILL_TOKENS_FROM, max_step_tokens)
    keys = doubling(PREFILL_TOKENS_FROM, min(max_context, DECODE_LENGTHS_UP_TO))
    return ShapeClasses(tuple(
        (length, fitting) for length in keys
        if (fitting := tuple(q for q in queries if q <= length))))
