"""Penalties, logit_bias and min_tokens on a forward's logits, for all its rows at once.

Applied before the sampler (execution/sampling.py), in this order, each one tensor op over
the whole batch [rows, vocab] (no loop over the rows on the device):

1. repetition_penalty r on every token of the prompt or the output: a positive logit is
   divided by r, a negative one multiplied by it (CTRL, as vLLM and transformers);
2. frequency_penalty f and presence_penalty p on the output's tokens: logit -= f * count +
   p * (count > 0) (as OpenAI);
3. logit_bias added (each already clamped to +-100, models/penalty_params.py);
4. min_tokens: the EOS tokens at -inf while the row has drawn fewer tokens.

The counts are rebuilt every step from the sequence's tokens (one scatter_add over the
rows' padded token ids), so nothing is kept between steps: a resumed or preempted sequence
has the same state as one that never stopped. A row whose newest token is still in flight
(overlapped steps, execution/staging.py) counts it from the device. A row that uses none of
these fields is unchanged to the bit (x / 1, x * 1, x - 0 and x + 0 are x); a forward where
no row uses them skips this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.models.generation_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RowPenalties:
    """What the penalties need of a forward's rows, gathered on the host."""

    params: list[SamplingParams]
    output: list[list[int]]  # each row's generated tokens on the host
    prompts: list[list[int]]  # each row's prompt where its repetition_penalty is not 1
    late: list[bool]  # whether the row's newest token is in flight (counted on the device)
    drawn: list[int]  # tokens the row has drawn before this one (the one in flight too)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], output: Sequence[list[int]],
           prompts: Sequence[list[int]], late: Sequence[bool]) -> RowPenalties | None:
        """None when no row is penalised (the forward's logits are left as they are)."""
        if not any(p.penalised for p in params):
            return None
        return cls(list(params), list(output),
                   [prompt if p.repetition_penalty != 1.0 else []
                    for p, prompt in zip(params, prompts, strict=True)],
                   list(late), [len(o) + f for o, f in zip(output, late, strict=True)])

    def apply(self, logits: torch.Tensor, newest: torch.Tensor | None,
              eos_ids: Sequence[int]) -> torch.Tensor:
        """The penalised logits (float32) of logits [rows, vocab]; `newest` [rows]: each
        row's last input token on the device (read for the rows whose token is late)."""
        rows, vocab = logits.shape
        scores = logits.float()
        counts = self._counts(rows, vocab, logits.device, newest)
        device = logits.device
        if any(p.repetition_penalty != 1.0 for p in self.params):
            seen = token_mask(self.prompts, vocab, logits.device) | (counts > 0)
            r = self._column("repetition_penalty", device)
            scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
        if any(p.frequency_penalty or p.presence_penalty for p in self.params):
            scores = scores - self._column("frequency_penalty", device) * counts \
                - self._column("presence_penalty", device) * (counts > 0)
        if any(p.logit_bias for p in self.params):
            scores = add_bias(scores, [p.logit_bias for p in self.params])
        blocked = [i for i, (p, n) in enumerate(zip(self.params, self.drawn, strict=True))
                   if n < p.min_tokens]
        if blocked and eos_ids:
            scores = block(scores, blocked, sorted(eos_ids))
        return scores

    def _column(self, name: str, device: torch.device) -> torch.Tensor:
        """[rows, 1] float32: each row's parameter `name`."""
        values = [float(getattr(p, name)) for p in self.params]
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    def _counts(self, rows: int, vocab: int, device: torch.device,
                newest: torch.Tensor | None) -> torch.Tensor:
        counts = token_counts(self.output, vocab, device)
        late = [i for i, flying in enumerate(self.late) if flying]
        if late and newest is not None:
            at = torch.tensor(late, device=device)
            counts.index_put_((at, newest[at].long()), torch.ones(len(late), device=device),
                              accumulate=True)
        return counts


def padded(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[rows, longest] long: each list padded with `pad` (at least one column)."""
    width = max(1, max(map(len, lists), default=0))
    return torch.tensor([list(ids) + [pad] * (width - len(ids)) for ids in lists],
                        dtype=torch.long, device=device)


def token_counts(lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token is in each row's list (one scatter)."""
    ids = padded(lists, vocab, device)  # the pad lands in a column dropped after
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab].contiguous()


def token_mask(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool: whether each token is in each row's list."""
    return token_counts(lists, vocab, device) > 0


def add_bias(scores: torch.Tensor,
             biases: Sequence[tuple[tuple[int, float], ...]]) -> torch.Tensor:
    """Each row's (token id, bias) pairs added, all rows in one index_put."""
    rows = [i for i, pairs in enumerate(biases) for _ in pairs]
    ids = [token for pairs in biases for token, _ in pairs]
    values = [bias for pairs in biases for _, bias in pairs]
    device = scores.device
    return scores.index_put((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                            torch.tensor(values, dtype=scores.dtype, device=device),
                            accumulate=True)


def block(scores: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
    """The tokens at -inf in the given rows (min_tokens' EOS)."""
    device = scores.device
    at = torch.tensor(list(rows), device=device)[:, None]
    ids = torch.tensor(list(token_ids), device=device)[None]
    return scores.index_put((at, ids), torch.tensor(float("-inf"), device=device))
