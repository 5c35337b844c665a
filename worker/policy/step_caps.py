"""The caps on a generative step's size under device memory: halved when a step runs out of
memory, grown back once steps have run clean for a while.

Why: a generative worker's KV cache is allocated at start, but a step's activations are not:
an eager step larger than any warm-up, fragmentation, or another process on the same GPU can
still run a step out of memory. Its sequences are then recomputed (pipeline/generate.py), never
lost, and the scheduler plans smaller steps, as the embeddings governor shrinks batches
(policy/governor.py). Pure: counts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_STEP_TOKENS = 16  # a block: a prefill still advances in chunks of it, one sequence at a time
GROW_AFTER_STEPS = 64  # clean steps before a cap doubles again


@dataclass(slots=True)
class StepCaps:
    max_step_tokens: int  # the configured limits, never exceeded
    max_seqs: int
    grow_after: int = GROW_AFTER_STEPS
    tokens: int = field(init=False)  # what the scheduler plans with now
    seqs: int = field(init=False)
    clean: int = 0  # steps since the last shrink or growth

    def __post_init__(self) -> None:
        self.tokens, self.seqs = self.max_step_tokens, self.max_seqs

    def on_out_of_memory(self, tokens: int, rows: int, decoding: bool) -> bool:
        """A forward of `tokens` new tokens in `rows` sequences ran out of memory: the cap
        that sized it is cut to half that forward (prefill chunks: the step's tokens, down to
        a block; decoding rows: the sequences, down to one). False if it was as small as it
        gets: its sequences cannot run, and are failed rather than retried."""
        floor = min(MIN_STEP_TOKENS, self.max_step_tokens)
        if not decoding and tokens > floor:
            self.tokens = max(floor, min(self.tokens, tokens) // 2)
        elif rows > 1:
            self.seqs = max(1, min(self.seqs, rows) // 2)
        else:
            return False
        self.clean = 0
        return True

    def on_step(self) -> None:
        """A step ran: after `grow_after` of them in a row, double the caps (up to the
        configured limits)."""
        if self.tokens == self.max_step_tokens and self.seqs == self.max_seqs:
            return
        self.clean += 1
        if self.clean >= self.grow_after:
            self.tokens = min(self.max_step_tokens, self.tokens * 2)
            self.seqs = min(self.max_seqs, self.seqs * 2)
            self.clean = 0
