"""Choosing the next token of every row of a forward at once, on the logits' device.

Greedy when a row's `temperature` is 0; otherwise temperature, top-k and top-p (nucleus)
filtering and a Gumbel-max draw: argmax(logits / temperature + g), g = -log(-log(u)). The
uniforms u come from a counter-based hash of the row's key and the token id, in tensor ops
(no torch.Generator, which cannot be batched), and a row's key comes from (seed, index of
the token it draws): the draws of a seeded request do not depend on which other requests
share the batch, nor on preemptions or on a resume by another worker. An unseeded request
is seeded by its entropy (GenerationEngine.add).

Everything but the (seed, index) -> key mixing runs in tensor ops over the whole batch: when
a row filters, one top-k of the largest top-k (a sort when a row has top-p alone), no
per-row host copy, the chosen tokens are the only result. EOS is not looked for here: the
host sees each chosen token anyway (detokenize.py's TextState stops on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.models.generation_params import SamplingParams

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
INPUTS_PER_ROW = 4  # temperature and top_p (float64 bits), top_k, key


def splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.'s SplitMix64 finaliser), on host integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_key(seed: int, index: int) -> int:
    """The key of the draw of a sequence's `index`-th token, as a signed int64."""
    key = splitmix64(splitmix64(seed & _M64) ^ index)
    return key - (1 << 64) if key >= 1 << 63 else key


@dataclass(frozen=True, slots=True)
class RowDraws:
    """What the sampler needs of a forward's rows, decided on the host."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    keys: list[int]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
           indices: Sequence[int]) -> RowDraws:
        return cls([p.temperature for p in params], [p.top_p for p in params],
                   [p.top_k for p in params],
                   [draw_key(s, i) for s, i in zip(seeds, indices, strict=True)])

    @property
    def samples(self) -> bool:
        """Whether any row draws (else the step is one argmax)."""
        return any(t != 0 for t in self.temperature)

    @property
    def filters(self) -> bool:
        """Whether any drawing row has top-k or top-p (else no sort is needed)."""
        return any(t != 0 and (k > 0 or p < 1.0)
                   for t, k, p in zip(self.temperature, self.top_k, self.top_p, strict=True))

    def candidates(self, vocab: int) -> int:
        """How many of the best tokens the drawing rows can keep: the largest top-k, or
        the whole vocabulary if one draws without a top-k."""
        return max((min(k, vocab) if k > 0 else vocab
                    for t, k in zip(self.temperature, self.top_k, strict=True) if t != 0),
                   default=vocab)

    def packed(self) -> torch.Tensor:
        """[INPUTS_PER_ROW x rows] int64: the floats by their bits (one copy for all)."""
        floats = torch.tensor(self.temperature + self.top_p, dtype=torch.float64)
        return torch.cat([floats.view(torch.int64), torch.tensor(self.top_k + self.keys)])


def choose_tokens(logits: torch.Tensor, draws: RowDraws,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row of logits [rows, vocab], on their device ([rows], long).
    `packed`: draws.packed() already on the device (else it is copied here)."""
    greedy = torch.argmax(logits, dim=-1)
    if not draws.samples:
        return greedy
    if packed is None:
        packed = draws.packed().to(logits.device)
    rows = logits.shape[0]
    temperature = packed[:rows].view(torch.float64)
    top_p = packed[rows:2 * rows].view(torch.float64)
    top_k, keys = packed[2 * rows:3 * rows], packed[3 * rows:4 * rows]
    scores = logits.float()
    # Shifted so the best score is 0 before the division, and the temperature kept above 0
    # in float32 (1e-300 is not): however small, no score becomes NaN (0 / tiny is 0).
    divisor = temperature.float().clamp_min(torch.finfo(torch.float32).tiny)
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / divisor[:, None]
    if draws.filters:
        drawn = _filtered_draw(scores, top_k, top_p, keys, draws.candidates(scores.shape[-1]))
    else:
        ids = torch.arange(scores.shape[-1], device=scores.device)[None]
        drawn = torch.argmax(scores + gumbel(keys, ids), dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


def _filtered_draw(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   keys: torch.Tensor, width: int) -> torch.Tensor:
    """The draw among each row's top k (the best `width` of all rows are sorted, not the
    whole vocabulary), then within its nucleus top_p of what top-k kept; a row always
    keeps its best token. The nucleus comes from a prefix sum (no softmax over the width):
    a row's tokens and draw do not depend on the other rows' width."""
    vocab = scores.shape[-1]
    ordered, order = torch.topk(scores, width, dim=-1) if width < vocab else \
        torch.sort(scores, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(width)
    keep = torch.arange(width, device=scores.device)[None] < k[:, None]
    mass = torch.exp(ordered).masked_fill(~keep, 0.0)  # the best score is 0: no overflow
    before = torch.cumsum(mass, dim=-1)
    total = before.gather(1, (k - 1)[:, None])
    keep &= ((before - mass) <= top_p[:, None] * total) | (top_p >= 1.0)[:, None]
    noisy = ordered.masked_fill(~keep, float("-inf")) + gumbel(keys, order)
    return order.gather(1, torch.argmax(noisy, dim=-1, keepdim=True))[:, 0]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Thomas Mueller's) on int64 tensors holding 32-bit values; its
    multiplier is below 2^27, so no product overflows int64: exact on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniforms(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 in (0, 1), one per token id of `ids` ([rows, n] or [1, n]): a hash of the
    row's key and the token id, so a token's number is the same wherever it sits."""
    low, high = keys & _M32, (keys >> 32) & _M32
    mixed = _mix32(_mix32(ids ^ high[:, None]) ^ low[:, None])
    # (2^24 - 0.5) / 2^24 rounds to 1.0 in float32, whose Gumbel noise is +inf: that token
    # would win whatever its logit (-inf: a masked one, NaN), so the top value is kept below 1
    return (((mixed >> 8).float() + 0.5) * 2.0 ** -24).clamp_max(1.0 - 2.0 ** -24)


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise of each row's key, one per token id of `ids`."""
    return -torch.log(-torch.log(uniforms(keys, ids)))
