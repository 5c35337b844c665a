"""What a launched generative step gives back (execution/generation.py): the step on its
way to the host, what it could not run, and the text deltas it produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker.execution.detokenize import Delta
from worker.execution.staging import Forward, TokensInFlight
from worker.policy.decoding import Work


@dataclass(slots=True)
class StepOutput:
    deltas: list[Delta] = field(default_factory=list)  # one per sequence that sampled

    @property
    def finished(self) -> list[str]:
        return [d.id for d in self.deltas if d.finish_reason]


@dataclass(frozen=True, slots=True)
class Unrun:
    """The work a step could not run for want of device memory: that of the forward that
    ran out, and of the forwards after it."""

    ran_out: list[Work]
    after: list[Work]
    decoding: bool  # the forward that ran out was the decoding rows' (else prefill chunks)

    @property
    def works(self) -> list[Work]:
        return self.ran_out + self.after

    @property
    def tokens(self) -> int:
        """The new tokens of the forward that ran out."""
        return sum(work.tokens for work in self.ran_out)


@dataclass(slots=True)
class Launched:
    """A step on its way: the forwards whose tokens come back with `finish`, and those
    tokens, copied to the host (once `copied` has happened, on CUDA)."""

    forwards: list[Forward]
    tokens: torch.Tensor | None
    copied: Any  # a torch.cuda.Event, or None: on the host already
    flight: TokensInFlight | None
    early: list[Delta]  # prefilled rows' deltas, appended mid-step (`on_prefilled`)
    unrun: Unrun | None = None  # the device ran out of memory: what did not run


def emitting_rows(forwards: list[Forward]) -> dict[str, int]:
    """Each emitting sequence's row in the step's tokens: a token per real row of each
    forward, in order, whether it emits or not."""
    rows: dict[str, int] = {}
    at = 0
    for forward in forwards:
        for seq, work in zip(forward.seqs, forward.works, strict=True):
            if work.emits:
                rows[seq.id] = at
            at += 1
    return rows
