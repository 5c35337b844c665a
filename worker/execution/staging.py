"""A step's forwards, staged: each forward's rows, their layout in the KV pool
(execution/step_layouts.py), token ids and sampler inputs, built on the host as lists and
copied to the device in one upload (execution/step_buffers.py).

A decoding row's input token is the one its sequence sampled last. While the generate loop
overlaps steps (pipeline/generate.py, on a GPU), that token may still be on its way to the
host: the previous step was launched and not yet finished. Such a row reads it on the
device, from that step's tokens (`TokensInFlight`): its id is a placeholder in the upload,
and one index copy after the upload puts the real one in place, so the host never waits for
it. Its draw is the one it would have made in order: the token in flight counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.execution.detokenize import TextState
from worker.execution.kv_pool import KVPool
from worker.execution.paged_attention import Layout
from worker.execution.penalties import PARTS, RowPenalties
from worker.execution.sampling import RowDraws
from worker.execution.step_buffers import StepBuffers
from worker.execution.step_layouts import DecodeLayout, PackedLayout, StepLayout
from worker.policy.decoding import Work
from worker.policy.shape_classes import ShapeClasses


@dataclass(slots=True)
class EngineSeq:
    id: str
    prompt_ids: list[int]
    text: TextState
    seed: int  # its draws' (execution/sampling.py): the request's seed, or its entropy
    blocks: list[int] = field(default_factory=list)  # its block table in the pool
    slots: list[int] = field(default_factory=list)  # its tokens' slots, as far as reserved
    cached: int = 0  # tokens whose keys and values are in its blocks
    ended: bool = False  # its last token is in: a step launched before that is ignored
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # its tokens' (logprobs.py)
    fork_of: str | None = None  # a sequence whose prompt blocks it may share (forks.py)
    matcher: Any = None  # its llguidance matcher (execution/grammar_mask.py), if constrained

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens [start, end) that are on the host (not one still in flight)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:  # a decode: no copy of the whole sequence
            return self.text.generated[start - prompt:end - prompt]
        return (self.prompt_ids + self.text.generated)[start:end]


@dataclass(slots=True)
class TokensInFlight:
    """The last launched step's tokens, on the device, not yet appended on the host."""

    tokens: torch.Tensor  # one per row of the step's emitting forwards
    rows: dict[str, int]  # sequence id -> the index of its new token


@dataclass(slots=True)
class Forward:
    """One forward of a step, staged: its rows, their layout, ids and draws."""

    seqs: list[EngineSeq]
    works: list[Work]
    layout: Layout
    ids: list[int]  # rows x queries, padded; a device view once uploaded
    draws: RowDraws | None  # None when no row emits a token
    batched: bool = False  # the step's decode rows together (else prefill chunks)
    late: tuple[list[int], list[int]] = field(  # ids positions, their tokens in flight
        default_factory=lambda: ([], []))
    device: list[torch.Tensor] = field(default_factory=list)  # ids (and draws) on device
    penalties: RowPenalties | None = None  # None when no row is penalised
    logprobs: int | None = None  # the alternatives its tail carries back (logprobs.py)


def reserve(pool: KVPool, seqs: Sequence[EngineSeq], works: Sequence[Work]) -> None:
    """Reserve the rows' blocks and work out their slots up to the work."""
    for seq, work in zip(seqs, works, strict=True):
        assert seq.cached == work.start, (seq.id, seq.cached, work.start)
        pool.reserve(seq.blocks, work.end)
        if work.end > len(seq.slots):  # only the new tokens' slots are worked out
            seq.slots += pool.slot_list(seq.blocks, work.end, len(seq.slots))


def input_ids(seqs: Sequence[EngineSeq], works: Sequence[Work], width: int,
              flight: TokensInFlight | None) -> tuple[list[int], tuple[list[int], list[int]]]:
    """Each row's tokens left-padded to `width` (1 for a decode row), one after another,
    and where a row's token is in flight: (its position in the ids, its index there)."""
    ids: list[int] = []
    late: tuple[list[int], list[int]] = ([], [])
    for seq, work in zip(seqs, works, strict=True):
        known = seq.tokens(work.start, work.end)
        ids += [0] * (width - work.tokens) + known
        if len(known) < work.tokens:  # its last token is not on the host yet: in flight
            assert flight is not None and work.tokens == 1, (seq.id, work)
            late[0].append(len(ids))
            late[1].append(flight.rows[seq.id])
            ids.append(0)
    return ids, late


def row_draws(seqs: Sequence[EngineSeq], works: Sequence[Work],
              flight: TokensInFlight | None) -> RowDraws | None:
    """The sampler's inputs, each row's draw numbered by its tokens, the one in flight too."""
    if not any(w.emits for w in works):
        return None
    flying = flight.rows if flight is not None else {}
    return RowDraws.of([s.text.params for s in seqs], [s.seed for s in seqs],
                       [len(s.text.generated) + (s.id in flying) for s in seqs])


def row_penalties(seqs: Sequence[EngineSeq], works: Sequence[Work],
                  flight: TokensInFlight | None) -> RowPenalties | None:
    """The penalties' inputs (None when no row is penalised or none emits)."""
    if not any(w.emits for w in works):
        return None
    flying = flight.rows if flight is not None else {}
    return RowPenalties.of([s.text.params for s in seqs], [s.text.generated for s in seqs],
                           [s.prompt_ids for s in seqs], [s.id in flying for s in seqs],
                           seqs[0].text.eos_ids)


def row_forward(pool: KVPool, seqs: Sequence[EngineSeq], works: Sequence[Work],
                flight: TokensInFlight | None) -> Forward:
    """Rows attending one at a time (a CPU): ids left-padded to the longest row."""
    reserve(pool, seqs, works)
    layout = StepLayout(pool, [s.blocks for s in seqs], [w.start for w in works],
                        [w.end for w in works], bind=False, slots=[s.slots for s in seqs])
    ids, late = input_ids(seqs, works, layout.queries, flight)
    return Forward(list(seqs), list(works), layout, ids, row_draws(seqs, works, flight),
                   late=late, penalties=row_penalties(seqs, works, flight))


def decode_forward(pool: KVPool, classes: ShapeClasses, seqs: Sequence[EngineSeq],
                   works: Sequence[Work], flight: TokensInFlight | None) -> Forward:
    """The decoding rows padded to their shape class (or, past every class, to their own
    count and longest context): one token each, real rows first."""
    reserve(pool, seqs, works)
    longest = max(w.end for w in works)
    shape = classes.fit(len(works), longest) or (len(works), longest)
    layout = DecodeLayout(pool, [s.blocks for s in seqs], [w.end for w in works], shape,
                          bind=False)
    ids, late = input_ids(seqs, works, 1, flight)
    return Forward(list(seqs), list(works), layout, ids + [0] * (layout.rows - len(ids)),
                   row_draws(seqs, works, flight), late=late,
                   penalties=row_penalties(seqs, works, flight))


def packed_forward(pool: KVPool, classes: ShapeClasses, max_rows: int,
                   seqs: Sequence[EngineSeq], works: Sequence[Work]) -> Forward:
    """The step's prefill chunks one after another in one row, padded at the end to their
    (queries, keys) class (or, past every class, not at all)."""
    reserve(pool, seqs, works)
    queries, keys = sum(w.tokens for w in works), sum(w.end for w in works)
    # + 1 key: padding queries must have a padding key to read (PackedLayout)
    shape = classes.fit(queries, keys + 1) if len(works) <= max_rows else None
    layout = PackedLayout(pool, [s.slots for s in seqs], [w.start for w in works],
                          [w.end for w in works], bind=False, shape=shape, rows=max_rows)
    ids: list[int] = []
    for seq, work in zip(seqs, works, strict=True):
        ids += seq.tokens(work.start, work.end)
    return Forward(list(seqs), list(works), layout, ids + [0] * (layout.queries - queries),
                   row_draws(seqs, works, None), penalties=row_penalties(seqs, works, None))


def upload(buffers: StepBuffers, forwards: Sequence[Forward],
           flight: TokensInFlight | None) -> None:
    """Every forward's inputs to the device in one copy; views bound to each forward and its
    layout; then the rows whose token is in flight read it there."""
    parts: list[Sequence[int] | torch.Tensor] = []
    for forward in forwards:
        parts += [forward.ids, *forward.layout.host]
        if forward.draws is not None and forward.draws.samples:
            parts.append(forward.draws.packed())
        if forward.penalties is not None:
            parts += forward.penalties.parts()
        if forward.late[0]:
            parts += forward.late
    views = iter(buffers.upload(parts))
    for forward in forwards:
        forward.device = [next(views)]
        forward.layout.bind(*[next(views) for _ in forward.layout.host])
        if forward.draws is not None and forward.draws.samples:
            forward.device.append(next(views))
        if forward.penalties is not None:
            forward.penalties.device = [next(views) for _ in range(PARTS)]
        if forward.late[0]:
            assert flight is not None
            at, index = next(views), next(views)
            forward.device[0].index_copy_(0, at, flight.tokens.index_select(0, index))
