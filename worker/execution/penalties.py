"""Penalties, logit_bias and min_tokens on a forward's logits, for all its rows at once.

Applied before the sampler (execution/sampling.py), in this order, each one tensor op over
the whole batch [rows, vocab] (no loop over the rows on the device):

1. repetition_penalty r on every token of the prompt or the output: a positive logit is
   divided by r, a negative one multiplied by it (CTRL, as vLLM and transformers);
2. frequency_penalty f and presence_penalty p on the output's tokens: logit -= f * count +
   p * (count > 0) (as OpenAI);
3. logit_bias added (each already clamped to +-100, models/penalty_params.py);
4. min_tokens: the EOS tokens at -inf while the row has drawn fewer tokens.

Their inputs (the rows' padded token ids, parameters as float64 bits, bias pairs, blocked
rows) ride in the step's one upload (execution/staging.py, step_buffers.py) as `parts`.
The counts are rebuilt every step from the sequence's tokens (one scatter_add over the
rows' padded ids), so nothing is kept between steps: a resumed or preempted sequence has
the same state as one that never stopped. A row whose newest token is still in flight
(overlapped steps) counts it from the device. A row that uses none of these fields is
unchanged to the bit (x / 1, x * 1, x - 0 and x + 0 are x); a forward where no row uses
them skips this module.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from worker.models.generation_params import SamplingParams

PARTS = 9  # output ids, prompt ids, parameters, bias rows, ids, values, blocked, EOS, late
COLUMNS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(slots=True)
class RowPenalties:
    """What the penalties need of a forward's rows, gathered on the host."""

    params: list[SamplingParams]
    output: list[list[int]]  # each row's generated tokens on the host
    prompts: list[list[int]]  # each row's prompt where its repetition_penalty is not 1
    late: list[bool]  # whether the row's newest token is in flight (counted on the device)
    drawn: list[int]  # tokens the row has drawn before this one (the one in flight too)
    eos_ids: tuple[int, ...] = ()
    device: list[torch.Tensor] = field(default_factory=list)  # the parts, once uploaded

    @classmethod
    def of(cls, params: Sequence[SamplingParams], output: Sequence[list[int]],
           prompts: Sequence[list[int]], late: Sequence[bool],
           eos_ids: Collection[int] = ()) -> RowPenalties | None:
        """None when no row is penalised (the forward's logits are left as they are)."""
        if not any(p.penalised for p in params):
            return None
        return cls(list(params), list(output),
                   [prompt if p.repetition_penalty != 1.0 else []
                    for p, prompt in zip(params, prompts, strict=True)],
                   list(late), [len(o) + f for o, f in zip(output, late, strict=True)],
                   tuple(sorted(eos_ids)))

    def parts(self) -> list[Sequence[int] | torch.Tensor]:
        """The inputs as int64 parts for the step's upload (padding ids are -1)."""
        floats = [float(getattr(p, name)) for name in COLUMNS for p in self.params]
        bias_rows = [i for i, p in enumerate(self.params) for _ in p.logit_bias]
        pairs = [pair for p in self.params for pair in p.logit_bias]
        values = torch.tensor([b for _, b in pairs], dtype=torch.float64).view(torch.int64)
        blocked = [i for i, (p, n) in enumerate(zip(self.params, self.drawn, strict=True))
                   if n < p.min_tokens and self.eos_ids]
        return [padded(self.output), padded(self.prompts),
                torch.tensor(floats, dtype=torch.float64).view(torch.int64), bias_rows,
                [token for token, _ in pairs], values, blocked, list(self.eos_ids),
                [i for i, flying in enumerate(self.late) if flying]]

    def apply(self, logits: torch.Tensor, newest: torch.Tensor | None) -> torch.Tensor:
        """The penalised logits (float32) of logits [rows, vocab]; `newest` [rows]: each
        row's last input token on the device (read for the rows whose token is late)."""
        if not self.device:  # not uploaded with a step (tests, tools): copied here
            self.device = [torch.as_tensor(part, dtype=torch.long, device=logits.device)
                           for part in self.parts()]
        output, prompts, floats, bias_rows, bias_ids, values, blocked, eos, late = self.device
        rows, vocab = logits.shape
        scores = logits.float()
        counts = token_counts(output.view(rows, -1), vocab)
        if late.numel() and newest is not None:  # their newest token, from the device
            counts.index_put_((late, newest[late].long()),
                              torch.ones(late.shape, device=logits.device), accumulate=True)
        repetition, frequency, presence = floats.view(torch.float64).float().view(3, rows, 1)
        if any(p.repetition_penalty != 1.0 for p in self.params):
            seen = (token_counts(prompts.view(rows, -1), vocab) > 0) | (counts > 0)
            scores = torch.where(seen, torch.where(scores > 0, scores / repetition,
                                                   scores * repetition), scores)
        if any(p.frequency_penalty or p.presence_penalty for p in self.params):
            scores = scores - frequency * counts - presence * (counts > 0)
        if bias_rows.numel():
            scores = scores.index_put((bias_rows, bias_ids),
                                      values.view(torch.float64).float(), accumulate=True)
        if blocked.numel():
            scores = scores.index_put((blocked[:, None], eos[None]),
                                      torch.full((), float("-inf"), device=logits.device))
        return scores


def padded(lists: Sequence[Sequence[int]]) -> list[int]:
    """Each list padded with -1 to the longest (at least one column), one after another."""
    width = max(1, max(map(len, lists), default=0))
    return [token for ids in lists for token in [*ids, *[-1] * (width - len(ids))]]


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32: how often each token is in each row of ids [rows, width]
    (-1 pads, counted in a column dropped after): one scatter."""
    ids = torch.where(ids < 0, vocab, ids)
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]
