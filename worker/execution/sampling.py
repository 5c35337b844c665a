"""Choosing the next token, and turning generated tokens into streamed text.

Greedy when `temperature` is 0; otherwise temperature, top-k and top-p (nucleus) filtering
and a draw from the sequence's own random numbers: with a `seed`, the draw for its n-th token
comes from a torch.Generator seeded by (seed, n), so the output does not depend on which
other sequences share the batch, or on preemptions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MAX_STOP_STRINGS = 4
_SEED_MIX = 1_000_003


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


def generator_for(seed: int, index: int) -> torch.Generator:
    """The random numbers of a seeded sequence's `index`-th token."""
    return torch.Generator().manual_seed((seed * _SEED_MIX + index) % (1 << 63))


def choose_token(logits: torch.Tensor, params: SamplingParams, index: int,
                 own: torch.Generator | None = None) -> int:
    """The next token from one row of logits (vocab,)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return _draw(logits.cpu(), params, index, own)


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  indices: Sequence[int], own: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row of logits (rows, vocab), as choose_token would choose it,
    with one argmax for every row and one device-to-host copy (two if a row samples)."""
    tokens: list[int] = torch.argmax(logits, dim=-1).tolist()  # why: one copy, not one a row
    drawn = [row for row, p in enumerate(params) if p.temperature != 0]
    if drawn:
        host = logits.cpu()  # the draws run on the host, in float64, as choose_token's do
        for row in drawn:
            tokens[row] = _draw(host[row], params[row], indices[row], own[row])
    return tokens


def _draw(logits: torch.Tensor, params: SamplingParams, index: int,
          own: torch.Generator | None) -> int:
    """A draw from one row of host logits under temperature, top-k and top-p."""
    scores = logits.double()  # float64: a temperature of 1e-300 is not rounded to 0
    # Shifted so the best score is 0 before the division: softmax is unchanged, and however
    # small the temperature, no score overflows to inf (inf - inf would be NaN).
    scores = (scores - scores.max()) / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        beyond = torch.cumsum(probs, dim=-1) - probs > params.top_p  # keeps at least one
        scores = scores.index_fill(0, order[beyond], float("-inf"))
    generator = generator_for(params.seed, index) if params.seed is not None else own
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class Delta:
    """What one step added to a sequence's answer: text and the tokens behind it."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"


@dataclass(slots=True)
class TextState:
    """The generated tokens of one sequence and the part of their text already streamed.

    Text that could still turn out to be the start of a stop string, or an incomplete
    UTF-8 character, is held back until it is settled, so no streamed text is ever taken
    back."""

    params: SamplingParams
    eos_ids: frozenset[int]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0

    def append(self, seq_id: str, token: int, decode: Callable[[Sequence[int]], str]) -> Delta:
        self.generated.append(token)
        reason = None
        if token in self.eos_ids:
            reason = "stop"
        else:
            self.text = decode(self.generated)
            cut = self._stop_at()
            if cut is not None:
                self.text, reason = self.text[:cut], "stop"
        if reason is None and len(self.generated) >= self.params.max_new_tokens:
            reason = "length"
        visible = len(self.text) if reason else len(self.text) - self._held_back()
        delta = Delta(seq_id, self.text[self.sent_chars:visible],
                      self.generated[self.sent_tokens:], reason)
        if delta.text or reason:
            self.sent_chars, self.sent_tokens = max(visible, self.sent_chars), len(self.generated)
        else:
            delta.token_ids = []
        return delta

    def resume(self, tokens: Sequence[int], sent_text: str,
               decode: Callable[[Sequence[int]], str]) -> str | None:
        """Continue after `tokens` whose text `sent_text` was streamed already (a request
        taken over after a crash); returns the finish reason if they had ended it."""
        self.generated, self.sent_tokens = list(tokens), len(tokens)
        self.text, self.sent_chars = decode(self.generated), len(sent_text)
        if tokens and tokens[-1] in self.eos_ids:
            return "stop"
        cut = self._stop_at()
        if cut is not None:
            self.text = self.text[:cut]
            return "stop"
        return "length" if len(tokens) >= self.params.max_new_tokens else None

    def _stop_at(self) -> int | None:
        """Where the first stop string starts in the text, if one is there."""
        found = [i for i in (self.text.find(s, max(0, self.sent_chars - len(s)))
                             for s in self.params.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """The characters at the end that may still change: a partial UTF-8 character, or
        the longest tail that is a prefix of a stop string."""
        text = self.text
        held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.params.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held
